"""CoMoE's deployments (moetier/sim/deploy.py): fits by bytes on a hand-made shape, the merged routing, and what the
simulator makes of each."""

import dataclasses

import numpy as np
import pytest

from moetier.sim.deploy import (
    DEPLOYMENTS,
    Deployment,
    MergedLayers,
    fit,
    merged_routing,
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


# a merge of SHAPE as moetier_merged.groups records it: layer 1 keeps 0, 2, 5 (3 experts), layer 3 keeps 0, 4
HALVES = MergedLayers({1: (0, 0, 2, 2, 5, 5, 5, 2), 3: (0, 0, 0, 0, 4, 4, 4, 4)})


def test_a_merged_deployment_holds_what_the_merge_kept_in_each_layer():
    dense, room = SHAPE.dense_bytes("fp32"), 1000
    assert (HALVES.kept(1), HALVES.kept(3), HALVES.principals(1)) == (3, 2, (0, 2, 5))
    merged = fit(SHAPE, Deployment(True, False), dense + 5 * EXPERT + room, 0, room, "fp32", HALVES)
    assert merged.fits and merged.device_bytes == dense + 5 * EXPERT + room
    assert not fit(SHAPE, Deployment(True, False), dense + 5 * EXPERT + room - 1, 0, room, "fp32", HALVES).fits
    both = fit(SHAPE, Deployment(True, True), dense + 9 * EXPERT + room, 5 * EXPERT, room, "fp32", HALVES)
    assert both.fits and both.host_bytes == 5 * EXPERT and both.cache_slots == 5  # no more slots than experts held
    encoder = fit(SHAPE, Deployment(True, True, "encoder"), dense + 2 * EXPERT + EXPERT + room, 3 * EXPERT, room,
                  "fp32", HALVES)  # layer 3's 2 resident, layer 1's 3 behind a cache of one
    assert encoder.fits and encoder.host_bytes == 3 * EXPERT and encoder.cache_slots == 1


def test_a_merge_that_is_not_one_or_not_of_the_shape_is_refused():
    with pytest.raises(ValueError, match="needs the merge"):
        fit(SHAPE, Deployment(True, False), 10 ** 9, 0, 0, "fp32")
    with pytest.raises(ValueError, match="covers layers"):
        fit(SHAPE, Deployment(True, False), 10 ** 9, 0, 0, "fp32", MergedLayers({1: HALVES.groups[1]}))
    for bad in ((1, 0, 2, 2), (0, 2, 2, 9), ()):  # 0's principal 1 is not its own; an id beyond E; no experts
        with pytest.raises(ValueError, match="maps to itself"):
            MergedLayers({1: bad})
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
    halves = MergedLayers({layer: tuple(e // 2 * 2 for e in range(32)) for layer in s32.moe_layers})
    assert fit(s32, Deployment(True, False), 8 * gb, 32 * gb, gb // 2, "fp32", halves).fits


def test_a_synthetic_encoder_decoder_trace_has_prompts_and_generations():
    trace = generate_seq2seq(LOCALITY, 4, 8, 1, 2, [1, 3], sequences=3, prompt_tokens=5, new_tokens=4)
    assert trace.layers == [3] and trace.encoder.layers == [1] and trace.all_layers == [1, 3]
    assert trace.seq.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and trace.phase.tolist() == [0, 1, 1, 1] * 3
    assert trace.encoder.seq.tolist() == [0] * 5 + [1] * 5 + [2] * 5 and (trace.encoder.phase == 0).all()


def test_merged_routing_sends_each_token_to_its_experts_principal():
    trace = generate_seq2seq(LOCALITY, 4, 8, 1, 2, [1, 3], sequences=4, prompt_tokens=30, new_tokens=10)
    merged = merged_routing(trace, HALVES)
    assert merged.num_experts == 8 and merged.encoder.layers == [1] and merged.layers == [3]
    for original, table, layer in ((trace.encoder, merged.encoder, 1), (trace, merged, 3)):
        expected = np.asarray(HALVES.groups[layer])[original.topk_ids[:, 0, 0]]
        assert (table.topk_ids[:, 0, 0] == expected).all() and set(expected.tolist()) <= set(HALVES.principals(layer))


def test_merged_top_k_keeps_a_group_once_and_fills_with_the_most_used_principal():
    shape_trace = generate_seq2seq(LOCALITY, 4, 8, 2, 2, [1, 3], sequences=2, prompt_tokens=6, new_tokens=3)
    ids = np.zeros_like(shape_trace.topk_ids)
    ids[:, 0] = [[0, 1], [4, 5], [4, 2], [4, 6], [0, 4], [1, 6]]  # layer 3: 0, 1 share principal 0; 4, 5, 6 theirs 4
    trace = dataclasses.replace(shape_trace, topk_ids=ids.astype(np.int16))
    merged = merged_routing(trace, MergedLayers({1: HALVES.groups[1], 3: (0, 0, 2, 2, 4, 4, 4, 4)}))
    rows = merged.topk_ids[:, 0].tolist()
    assert rows == [[0, 4], [4, 0], [4, 2], [4, 0], [0, 4], [0, 4]]  # filled with 4, then 0: the most used principals


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


def test_a_merged_deployment_replays_its_principals_alone():
    """Resident, the merged model reads nothing (the cache filled with the principals, the tokens routed to them); behind
    the same small cache it reads less than the original, its tokens spread over 5 experts, not 16."""
    profile = HardwareProfile.load("nuc-a500")
    trace = generate_seq2seq(LOCALITY, 4, 8, 1, 2, [1, 3], sequences=3, prompt_tokens=20, new_tokens=6)
    big, merged, both = 10 ** 12, Deployment(True, False), Deployment(True, True)
    resident = request_latency(trace, SHAPE, merged, fit(SHAPE, merged, big, big, 0, "fp32", HALVES), profile, "fp32",
                               merged=HALVES)
    assert resident["hit_rate"] == 1.0 and resident["expert_bytes_per_request"] == 0
    room = SHAPE.dense_bytes("fp32") + 3 * EXPERT
    small = request_latency(trace, SHAPE, both, fit(SHAPE, both, room, big, 0, "fp32", HALVES), profile, "fp32",
                            merged=HALVES)
    original = request_latency(trace, SHAPE, Deployment(False, True), fit(SHAPE, Deployment(False, True), room, big, 0,
                               "fp32"), profile, "fp32")
    assert 0 < small["expert_bytes_per_request"] < original["expert_bytes_per_request"]
    with pytest.raises(ValueError, match="needs the merge"):
        request_latency(trace, SHAPE, merged, fit(SHAPE, merged, big, big, 0, "fp32", HALVES), profile, "fp32")
