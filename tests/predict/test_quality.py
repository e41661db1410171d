import numpy as np

from moetier.predict.quality import recall, top4_within_top6, top_ids


def onehot(ids: list[list[int]], num_experts: int) -> np.ndarray:
    scores = np.zeros((len(ids), num_experts), np.float32)
    for t, row in enumerate(ids):
        scores[t, row] = np.arange(len(row), 0, -1)
    return scores


def test_top_ids_highest_first_ties_to_the_lower_id():
    assert top_ids(np.array([[0.1, 0.5, 0.5, 0.2]]), 3).tolist() == [[1, 2, 3]]


def test_recall_counts_true_pairs_among_the_predicted_top_k():
    true_ids = np.array([[0, 1], [2, 3]])
    assert recall(onehot([[0, 1], [2, 3]], 6), true_ids) == 1.0
    assert recall(onehot([[1, 5], [4, 5]], 6), true_ids) == 0.25  # one pair of four
    assert recall(np.zeros((2, 6)), true_ids) == 0.5  # all ties: experts 0 and 1 guessed for both tokens


def test_top4_within_top6_ranks_by_tokens_then_score():
    # Two tokens, top-3 of 8. Volumes: expert 0 and 1 have two tokens each, 2..5 one each.
    true_ids = np.array([[0, 1, 2], [0, 1, 3]])
    true_scores = np.zeros((2, 8))
    true_scores[0, [0, 1, 2]] = [0.5, 0.3, 0.2]
    true_scores[1, [0, 1, 3]] = [0.4, 0.3, 0.1]
    # true hottest six: 0, 1 (two tokens), then 2 (0.2), 3 (0.1), then 4, 5 (no tokens, lower id first)
    assert top4_within_top6(onehot([[0, 1, 2], [0, 1, 3]], 8), true_ids, true_scores) == 1.0
    # predicted hottest four: 6 and 7 (two tokens each), then 0 (one token, larger score), then 1
    guess = onehot([[6, 7, 0], [6, 7, 1]], 8)
    assert top4_within_top6(guess, true_ids, true_scores) == 0.5
