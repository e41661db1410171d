"""CoMoE's deployments (moetier/sim/deploy.py): fits by bytes on a hand-made shape, the merged routing, and what the
simulator makes of each."""

import numpy as np
import pytest

from moetier.sim.deploy import (
    DEPLOYMENTS,
    Deployment,
    fit,
    merge_trace,
    merged_shape,
    request_latency,
    with_decoder_resident,
)
from moetier.sim.profile import HardwareProfile
from moetier.sim.shapes import SHAPES, ModelShape
from moetier.trace.synthetic import LocalityFit, generate_seq2seq

# 4 layers, the first 2 the encoder's; MoE layers 1 (encoder) and 3 (decoder); 8 experts of 2*16*32 fp32 params
SHAPE = ModelShape("tiny-s2s", 16, 4, (1, 3), 8, 1, 32, attention_params=2048, kv_per_token=64, vocab_size=100,
                   expert_matrices=2, encoder_layers=2, dense_intermediate_size=32, precision="fp32")
EXPERT = SHAPE.expert_bytes()  # one 4096-byte aligned blob
LOCALITY = LocalityFit(zipf_s=1.0, p_keep=0.3, reuse_next=0.0, source="hand-made")


def test_a_deployment_fits_by_what_the_device_and_the_host_must_hold():
    dense, room = SHAPE.dense_bytes("fp32"), 1000
    original = fit(SHAPE, Deployment(False, False), dense + 16 * EXPERT + room, 0, room, "fp32")
    assert original.fits and original.device_bytes == dense + 16 * EXPERT + room and original.host_bytes == 0
    assert not fit(SHAPE, Deployment(False, False), dense + 16 * EXPERT + room - 1, 0, room, "fp32").fits
    offloaded = fit(SHAPE, Deployment(False, True), dense + 5 * EXPERT + room, 16 * EXPERT, room, "fp32")
    assert offloaded.fits and offloaded.cache_slots == 5 and offloaded.offloaded_layers == (1, 3)
    assert offloaded.device_bytes == dense + EXPERT + room  # at least one layer's top-1 of cache
    short_host = fit(SHAPE, Deployment(False, True), dense + 5 * EXPERT + room, 16 * EXPERT - 1, room, "fp32")
    assert not short_host.fits and "host" in short_host.why
    encoder = fit(SHAPE, Deployment(False, True, "encoder"), dense + 8 * EXPERT + 3 * EXPERT + room, 8 * EXPERT, room,
                  "fp32")  # the decoder's 8 experts resident, a cache of 3 for the encoder's
    assert encoder.fits and encoder.offloaded_layers == (1,) and encoder.cache_slots == 3
    assert encoder.host_bytes == 8 * EXPERT


def test_merged_shapes_keep_the_floor_of_r_times_e_and_at_least_top_k():
    assert merged_shape(SHAPE, 0.5).num_experts == 4 and merged_shape(SHAPE, 0.3).num_experts == 2
    assert merged_shape(SHAPE, 0.01).num_experts == 1
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="merge ratio"):
            merged_shape(SHAPE, bad)
    with pytest.raises(ValueError, match="offload scope"):
        Deployment(False, True, "decoder")
    assert [d.name for d in DEPLOYMENTS][-1] == "merged+offloaded (encoder)"


def test_switch_fits_as_the_checkpoints_bytes_say():
    """Switch-Base-8 in fp32 (2.5 GB) fits a 4 GB device whole; Switch-Base-32 (7.9 GB) does not fit 8 GB, merged
    at r = 0.5 (4.3 GB) it does."""
    gb = 10 ** 9
    s8, s32 = SHAPES["switch-base-8"], SHAPES["switch-base-32"]
    assert fit(s8, Deployment(False, False), 4 * gb, 32 * gb, gb // 2, "fp32").fits
    assert not fit(s32, Deployment(False, False), 8 * gb, 32 * gb, gb // 2, "fp32").fits
    assert fit(merged_shape(s32, 0.5), Deployment(True, False), 8 * gb, 32 * gb, gb // 2, "fp32").fits


def test_a_synthetic_encoder_decoder_trace_has_prompts_and_generations():
    trace = generate_seq2seq(LOCALITY, 4, 8, 1, 2, [1, 3], sequences=3, prompt_tokens=5, new_tokens=4)
    assert trace.layers == [3] and trace.encoder.layers == [1] and trace.all_layers == [1, 3]
    assert trace.seq.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and trace.phase.tolist() == [0, 1, 1, 1] * 3
    assert trace.encoder.seq.tolist() == [0] * 5 + [1] * 5 + [2] * 5 and (trace.encoder.phase == 0).all()


def test_merged_routing_renumbers_into_the_principals():
    trace = generate_seq2seq(LOCALITY, 4, 8, 1, 2, [1, 3], sequences=4, prompt_tokens=30, new_tokens=10)
    merged = merge_trace(trace, 4)
    assert merged.num_experts == 4 and merged.encoder.num_experts == 4
    for original, table in ((trace, merged), (trace.encoder, merged.encoder)):
        assert table.topk_ids.max() < 4
        top = np.bincount(original.topk_ids[:, 0, 0]).argmax()  # the most used expert is principal 0
        assert (table.topk_ids[original.topk_ids[:, 0, 0] == top, 0, 0] == 0).all()


def test_the_simulator_times_each_deployment():
    """Resident reads nothing; a small cache reads and is slower; offloading the encoder alone leaves the decode
    steps as fast as resident ones (the decoder's experts stay)."""
    profile = HardwareProfile.load("nuc-a500")
    trace = generate_seq2seq(LOCALITY, 4, 8, 1, 2, [1, 3], sequences=3, prompt_tokens=20, new_tokens=6)
    big = 10 ** 12
    resident = request_latency(trace, SHAPE, Deployment(False, False), fit(SHAPE, Deployment(False, False), big, big,
                                                                          0, "fp32"), profile, "fp32")
    assert resident["hit_rate"] == 1.0 and resident["expert_bytes_per_request"] == 0
    small = fit(SHAPE, Deployment(False, True), SHAPE.dense_bytes("fp32") + 2 * EXPERT, big, 0, "fp32")
    offloaded = request_latency(trace, SHAPE, Deployment(False, True), small, profile, "fp32")
    assert small.cache_slots == 2 and offloaded["expert_bytes_per_request"] > 0
    assert offloaded["request_s"] > resident["request_s"] and offloaded["hit_rate"] < 1
    encoder_only = Deployment(False, True, "encoder")
    enc = request_latency(trace, SHAPE, encoder_only, fit(SHAPE, encoder_only, big, big, 0, "fp32"), profile, "fp32")
    assert enc["tpot_s"] == pytest.approx(resident["tpot_s"])
    assert with_decoder_resident(trace).all_layers == [1]
