"""Trace format version 1: routing decisions, one row per token step.

DIR/
  meta.json          format, version, model, num_layers, num_experts, top_k, layers (the model layer of each
                     column; a partial trace lists only the layers it has), source, prompts, synthetic, notes
  seq.npy [N] int32, pos.npy [N] int32, phase.npy [N] uint8 (0 prefill, 1 decode)
  topk_ids.npy [N, L, k] int16, topk_weights.npy [N, L, k] float16
  scores.npy [N, L, E] float16            optional: full router scores
  gate_inputs.npy [N, L, H] float16       optional: the router's input, for training predictors
  step.npy [N] int32                      optional: the forward step each row ran in, for a batched recording or
                                          an interleaved trace (trace/batch.py): a step's rows are contiguous and
                                          share it, non-decreasing. Without it a prompt's prefill is one step and
                                          each decode row another (batch 1)
  encoder/                                optional, an encoder-decoder's: the encoder's routing of the prompts, a
                                          trace of its own (one row per prompt token, phase 0, `seq` the sequence
                                          whose prompt it encodes, `pos` the token's place in it, `layers` the
                                          encoder's MoE layers, all before the decoder's)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moetier.atomic import atomic_dir, check_free_space, check_replaceable, marked_json
from moetier.errors import MoetierError, integer, parsing
from moetier.plan.route import PREFILL

FORMAT, VERSION = "moetier-trace", 1
ARRAYS = {"seq": np.int32, "pos": np.int32, "phase": np.uint8, "topk_ids": np.int16, "topk_weights": np.float16}
OPTIONAL = {"scores": np.float16, "gate_inputs": np.float16, "step": np.int32}


class TraceError(MoetierError):
    pass


def is_trace(path: Path) -> bool:
    """A folder moetier wrote as a trace: its meta.json says so."""
    return marked_json(path / "meta.json", "format", FORMAT)


@dataclass
class Trace:
    model: str
    num_layers: int
    num_experts: int
    top_k: int
    layers: list[int]  # model layer index of each column
    seq: np.ndarray
    pos: np.ndarray
    phase: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    scores: np.ndarray | None = None
    gate_inputs: np.ndarray | None = None
    source: str = ""
    prompts: list[str] = field(default_factory=list)
    synthetic: bool = False
    notes: list[str] = field(default_factory=list)
    encoder: Trace | None = None  # an encoder-decoder's encoder routing (module docstring)
    step: np.ndarray | None = None  # [N] the forward step of each row (module docstring); None: batch 1

    def __post_init__(self) -> None:
        self._check_encoder()
        self._check_steps()
        n = len(self.seq)
        kinds = {"seq": "iu", "pos": "iu", "phase": "iu", "topk_ids": "iu", "topk_weights": "fiu"}
        for name, allowed in kinds.items():
            if getattr(self, name).dtype.kind not in allowed:
                raise TraceError(f"{name} must hold numbers of kind {allowed!r}, got {getattr(self, name).dtype}")
        if self.topk_ids.ndim != 3 or self.topk_ids.shape[0] != n:
            raise TraceError(f"topk_ids must be [N={n}, L, k], got {self.topk_ids.shape}")
        _, cols, k = self.topk_ids.shape
        if cols != len(self.layers) or k != self.top_k:
            raise TraceError(f"topk_ids has {cols} layers of top-{k}; meta says {len(self.layers)} of top-{self.top_k}")
        if any(not 0 <= layer < self.num_layers for layer in self.layers):
            raise TraceError(f"layers {self.layers} fall outside the model's {self.num_layers} layers")
        if len(self.pos) != n or len(self.phase) != n or self.topk_weights.shape != self.topk_ids.shape:
            raise TraceError("seq, pos, phase and topk_weights must have one row per token step like topk_ids")
        if self.topk_ids.size and (self.topk_ids.min() < 0 or self.topk_ids.max() >= self.num_experts):
            bad = int(self.topk_ids.max())
            raise TraceError(f"expert id {bad} exceeds the model shape ({self.num_experts} experts per layer)",
                             hint="give the right number of experts for this model")
        if self.scores is not None and self.scores.shape != (n, cols, self.num_experts):
            raise TraceError(f"scores must be [N, L, E] = {(n, cols, self.num_experts)}, got {self.scores.shape}")

    def _check_steps(self) -> None:
        step = self.step
        if step is None:
            return
        if step.dtype.kind not in "iu" or step.shape != self.seq.shape:
            raise TraceError(f"step must hold one integer per row ({len(self.seq)}), got {step.dtype} {step.shape}")
        if len(step) and (np.diff(step.astype(np.int64)) < 0).any():
            raise TraceError("step must not decrease: a forward step's rows are contiguous")
        change = np.flatnonzero(np.diff(step.astype(np.int64)) == 0)  # consecutive rows of one step
        if (self.phase[change] != self.phase[change + 1]).any():
            raise TraceError("a forward step is a prefill or a decode step, not both")

    def _check_encoder(self) -> None:
        enc = self.encoder
        if enc is None:
            return
        if (enc.num_layers, enc.num_experts, enc.top_k) != (self.num_layers, self.num_experts, self.top_k):
            raise TraceError("the encoder's routing must have the decoder's layers, experts and top-k")
        if enc.encoder is not None or (len(enc.phase) and enc.phase.max() != PREFILL):
            raise TraceError("the encoder's routing is one prefill row per prompt token, with no encoder of its own")
        if self.layers and enc.layers and max(enc.layers) >= min(self.layers):
            raise TraceError(f"the encoder's layers {enc.layers} must come before the decoder's {self.layers}")

    @property
    def num_tokens(self) -> int:
        return len(self.seq)

    @property
    def all_layers(self) -> list[int]:
        """Every MoE layer the trace routes: the encoder's (if it has them), then its own columns'."""
        return [*(self.encoder.layers if self.encoder is not None else ()), *self.layers]

    def decoder_only(self) -> Trace:
        """The trace without its encoder's routing (itself if it has none)."""
        if self.encoder is None:
            return self
        return dataclasses.replace(self, encoder=None, notes=[*self.notes, "the encoder's routing set aside"])

    def encoder_rows(self) -> dict[int, np.ndarray]:
        """For each sequence, the encoder's rows of its prompt (empty without an encoder)."""
        if self.encoder is None:
            return {}
        order = np.argsort(self.encoder.seq, kind="stable")
        seqs, starts = np.unique(self.encoder.seq[order], return_index=True)
        return {int(s): rows for s, rows in zip(seqs, np.split(order, starts[1:]))}

    def split(self, fraction: float) -> tuple[Trace, Trace]:
        """The first `fraction` of the token steps and the rest, cut where a step starts (a prompt's prefill
        stays in one part)."""
        if not 0 < fraction < 1:
            raise ValueError(f"split fraction must be in (0, 1), got {fraction}")
        cut = round(fraction * self.num_tokens)
        while 0 < cut < self.num_tokens and (self.step[cut] == self.step[cut - 1] if self.step is not None else
                                             self.phase[cut] == PREFILL and self.phase[cut - 1] == PREFILL
                                             and self.seq[cut] == self.seq[cut - 1]):
            cut += 1
        if not 0 < cut < self.num_tokens:
            raise TraceError(f"a trace of {self.num_tokens} token steps cannot be split at {fraction:.0%}")
        return self.rows(slice(0, cut)), self.rows(slice(cut, self.num_tokens))

    def rows(self, index: slice) -> Trace:
        """The token steps in `index`, as a trace of its own."""
        start, stop, _ = index.indices(self.num_tokens)
        return self.take(index, f"token steps {start}..{stop - 1} of {self.num_tokens}")

    def take(self, index: slice | np.ndarray, note: str, step: np.ndarray | None = None) -> Trace:
        """The rows `index` (a slice or row numbers, in the order wanted) as a trace of its own, with `note`; `step`
        gives the new rows' forward steps (default: the rows' own, if the trace has them)."""
        pick = lambda a: None if a is None else a[index]  # noqa: E731
        return dataclasses.replace(self, seq=self.seq[index], pos=self.pos[index], phase=self.phase[index],
                                   topk_ids=self.topk_ids[index], topk_weights=self.topk_weights[index],
                                   scores=pick(self.scores), gate_inputs=pick(self.gate_inputs),
                                   step=step if step is not None else pick(self.step), notes=[*self.notes, note],
                                   encoder=self._encoder_of(self.seq[index][self.phase[index] == PREFILL]))

    def _encoder_of(self, seqs: np.ndarray) -> Trace | None:
        """The encoder's rows of the prompts of `seqs` (the sequences whose prefill a part of the trace holds)."""
        if self.encoder is None:
            return None
        keep = np.flatnonzero(np.isin(self.encoder.seq, seqs))
        enc = self.encoder
        pick = lambda a: None if a is None else a[keep]  # noqa: E731
        return dataclasses.replace(enc, seq=enc.seq[keep], pos=enc.pos[keep], phase=enc.phase[keep],
                                   topk_ids=enc.topk_ids[keep], topk_weights=enc.topk_weights[keep],
                                   scores=pick(enc.scores), gate_inputs=pick(enc.gate_inputs))

    @property
    def partial(self) -> bool:
        return len(self.layers) < self.num_layers

    def meta(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "top_k": self.top_k, "layers": self.layers,
                "missing_layers": [i for i in range(self.num_layers) if i not in self.layers],
                "num_tokens": self.num_tokens, "source": self.source, "prompts": self.prompts,
                "synthetic": self.synthetic, "has_scores": self.scores is not None,
                "has_gate_inputs": self.gate_inputs is not None, "batched": self.step is not None,
                "notes": self.notes,
                "encoder": None if self.encoder is None else {"layers": self.encoder.layers,
                                                              "num_tokens": self.encoder.num_tokens}}

    def save(self, out: Path | str, overwrite: bool = False, sources: tuple[Path | str, ...] = ()) -> Path:
        """Write the trace folder atomically. `overwrite` replaces an existing trace (only a trace: any other
        folder is refused), never one of `sources`."""
        check_replaceable(out, "trace", is_trace, overwrite, sources)
        check_free_space(out, self._nbytes() + (64 << 10) + len(json.dumps(self.meta())), f"the trace {Path(out).name}")
        with atomic_dir(out) as tmp:
            self._write(tmp)
        return Path(out)

    def _nbytes(self) -> int:
        arrays = [getattr(self, name) for name in {**ARRAYS, **OPTIONAL}]
        own = sum(np.asarray(a).nbytes for a in arrays if a is not None)
        return own + (self.encoder._nbytes() if self.encoder is not None else 0)

    def _write(self, folder: Path) -> None:
        for name, dtype in {**ARRAYS, **OPTIONAL}.items():
            value = getattr(self, name)
            if value is not None:
                np.save(folder / f"{name}.npy", np.asarray(value, dtype=dtype))
        if self.encoder is not None:
            (folder / "encoder").mkdir()
            self.encoder._write(folder / "encoder")
        (folder / "meta.json").write_text(json.dumps(self.meta(), indent=1))

    @classmethod
    def load(cls, path: Path | str) -> Trace:
        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_bytes())
        except FileNotFoundError:
            raise TraceError(f"{path} is not a trace (no meta.json)",
                             hint="record one with `moetier trace record` or import one with `moetier trace import`"
                             ) from None
        except (OSError, ValueError) as e:
            raise TraceError(f"cannot read {path / 'meta.json'}: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise TraceError(f"{path / 'meta.json'} is not a {FORMAT} version {VERSION} trace")
        arrays = {}
        for name in (*ARRAYS, *OPTIONAL):
            f = path / f"{name}.npy"
            if f.exists():
                arrays[name] = _load_array(f)
            elif name in ARRAYS:
                raise TraceError(f"trace {path} is missing {name}.npy")
        encoder = cls.load(path / "encoder") if meta.get("encoder") else None
        with parsing(str(path / "meta.json"), TraceError):
            return cls(encoder=encoder, model=str(meta["model"]), num_layers=integer(meta["num_layers"], "num_layers", 1),
                       num_experts=integer(meta["num_experts"], "num_experts", 1),
                       top_k=integer(meta["top_k"], "top_k", 1),
                       layers=[integer(x, "layer", 0) for x in meta["layers"]], source=str(meta.get("source", "")),
                       prompts=list(meta.get("prompts", [])), synthetic=bool(meta.get("synthetic", False)),
                       notes=list(meta.get("notes", [])), **arrays)


def _load_array(path: Path) -> np.ndarray:
    """One array of a trace; a truncated or foreign file is a TraceError naming it."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise TraceError(f"cannot read {path}: {e}", hint="the trace is damaged; record or import it again") from None
