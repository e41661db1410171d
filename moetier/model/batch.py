"""The tokens of one forward step, flattened: a packed prefill of several prompts, or one decode token each."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    rows: torch.Tensor  # [N] KV-cache row of each token
    last: torch.Tensor  # [B] index in N of each sequence's last token
    decode: bool
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)  # prefill: (row, first, start, length)
    rows_host: list[int] = field(default_factory=list)  # decode: KV rows, host copy
    lengths_host: list[int] = field(default_factory=list)  # decode: tokens in each row after this step
    all_rows: bool = False  # decode: rows are exactly 0..R-1 of the KV cache, so no gather is needed
    _masks: dict = field(default_factory=dict)

    @classmethod
    def prefill(cls, prompts: list[list[int]], rows: list[int], starts: list[int] | None = None,
                device: torch.device | str = "cpu") -> StepBatch:
        starts = starts or [0] * len(prompts)
        ids, pos, row_ids, segments, last, first = [], [], [], [], [], 0
        for p, row, start in zip(prompts, rows, starts):
            ids += p
            pos += range(start, start + len(p))
            row_ids += [row] * len(p)
            segments.append((row, first, start, len(p)))
            first += len(p)
            last.append(first - 1)
        t = lambda v: torch.tensor(v, device=device)  # noqa: E731
        return cls(t(ids), t(pos), t(row_ids), t(last), False, segments)

    @classmethod
    def decode_step(cls, token_ids: list[int], rows: list[int], positions: list[int], num_rows: int,
                    device: torch.device | str = "cpu") -> StepBatch:
        n = len(token_ids)
        t = lambda v: torch.tensor(v, device=device)  # noqa: E731
        return cls(t(token_ids), t(positions), t(rows), torch.arange(n, device=device), True,
                   rows_host=rows, lengths_host=[p + 1 for p in positions], all_rows=rows == list(range(num_rows)))

    @property
    def end(self) -> int:
        """One past the furthest position of the step."""
        if self.decode:
            return max(self.lengths_host)
        return max(start + length for _, _, start, length in self.segments)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, S] True where a row's key is visible to its query; built once per step, shared by layers."""
        mask = self._masks.get(window)
        if mask is None:
            keys = torch.arange(max(self.lengths_host), device=self.positions.device)
            q = self.positions[:, None]
            mask = keys[None, :] <= q
            if window:
                mask &= keys[None, :] > q - window
            mask = self._masks[window] = mask[:, None, None, :]
        return mask


def causal_mask(start: int, length: int, window: int | None,
                device: torch.device | str = "cpu") -> torch.Tensor | None:
    """[length, start+length] visibility for a prefill segment; None when plain causal attention will do."""
    if start == 0 and not window:
        return None
    q = torch.arange(start, start + length, device=device)[:, None]
    k = torch.arange(start + length, device=device)[None, :]
    mask = k <= q
    if window:
        mask &= k > q - window
    return mask
