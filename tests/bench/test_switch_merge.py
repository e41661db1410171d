"""bench/switch_merge.py: a Switch-shaped store merged by moetier's own merge, what CoMoE's Tables I-II hold."""

import numpy as np

from bench.switch_merge import merge_switch, split_sequences
from moetier.merge.plan import FixedRatio
from moetier.sim.shapes import SHAPES
from moetier.trace.synthetic import LocalityFit, generate_seq2seq


def test_switch_base_8_merged_for_real_keeps_the_most_used_experts_and_writes_their_bytes(tmp_path):
    shape = SHAPES["switch-base-8"]
    trace = generate_seq2seq(LocalityFit(1.2, 0.3, 0.0, "hand-made"), shape.num_layers, 8, 1, shape.encoder_layers,
                             list(shape.moe_layers), sequences=6, prompt_tokens=40, new_tokens=8, seed=3)
    calibration, requests = split_sequences(trace, 4)
    assert set(calibration.seq.tolist()) == {0, 1, 2, 3} and set(requests.seq.tolist()) == {4, 5}
    assert set(calibration.encoder.seq.tolist()) == {0, 1, 2, 3} and set(requests.encoder.seq.tolist()) == {4, 5}
    merged = merge_switch(8, calibration, FixedRatio(0.5), "all", tmp_path)
    assert list(merged.kept) == list(shape.moe_layers) and set(merged.kept.values()) == {4}
    assert merged.merged_bytes * 2 == merged.store_bytes and merged.method == "ratio-0.5"
    tables = [(calibration.encoder, j) for j in range(6)] + [(calibration, j) for j in range(6)]
    for layer, (table, j) in zip(shape.moe_layers, tables):
        counts = np.bincount(table.topk_ids[:, j, 0], minlength=8)
        principals = sorted(set(merged.groups[layer]))
        assert counts[principals].min() >= np.delete(counts, principals).max()  # Eq. 28: the most used kept
        assert all(merged.groups[layer][p] == p for p in principals)


def test_an_encoder_scoped_merge_leaves_the_decoders_experts_whole(tmp_path):
    shape = SHAPES["switch-base-8"]
    trace = generate_seq2seq(LocalityFit(1.2, 0.3, 0.0, "hand-made"), shape.num_layers, 8, 1, shape.encoder_layers,
                             list(shape.moe_layers), sequences=3, prompt_tokens=30, new_tokens=8, seed=4)
    merged = merge_switch(8, trace, FixedRatio(0.25), "encoder", tmp_path)
    assert [merged.kept[layer] for layer in shape.moe_layers] == [2] * 6 + [8] * 6
    assert merged.merged_bytes * 96 == merged.store_bytes * (6 * 2 + 6 * 8)  # of 12 layers of 8
