"""Hardware profiles: what the simulator needs to know about a machine, as a JSON data file.

Units: bytes, seconds, bytes per second. Fields:
  name, description, sources (list of where each figure comes from)
  fast_tier_bytes        memory the expert cache may use
  link                   the slow tier experts are read from: bandwidth_bytes_per_s, latency_s, utilisation
                         (the share of nominal bandwidth reached in practice; 1.0 for measured figures)
  expert_compute         time to run one expert over m tokens: t = beta_s_per_token * m + c_s (PreScope's
                         t_c = beta*m + C), for the expert shape and precision the profile was measured with
  dense_s_per_layer      attention, norms and router of one layer: {"per_token": s, "fixed": s}
  head_s                 embedding lookup, final norm and LM head per step: {"per_token": s, "fixed": s}
  executor_s_per_layer   optional: the executor's own cost per MoE layer (planning, grouping, policy events)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from moetier.errors import MoetierError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(MoetierError):
    pass


@dataclass(frozen=True)
class Linear:
    """time = per_token * tokens + fixed"""

    per_token: float
    fixed: float

    def __call__(self, tokens: int) -> float:
        return self.per_token * tokens + self.fixed


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    utilisation: float = 1.0

    def read_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.bandwidth_bytes_per_s * self.utilisation)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    fast_tier_bytes: int
    link: Link
    expert_compute: Linear
    dense_s_per_layer: Linear
    head_s: Linear
    description: str = ""
    sources: tuple[str, ...] = ()
    expert_bytes: int = 0  # the expert blob size the compute figures were measured for (0: not recorded)
    executor_s_per_layer: Linear = Linear(0.0, 0.0)

    def save(self, path: Path) -> None:
        d = asdict(self)
        d["sources"] = list(self.sources)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, name_or_path: str | Path) -> HardwareProfile:
        path = Path(name_or_path)
        if not path.suffix:  # a name: the user's calibrated profiles first, then the shipped ones
            user = Path.home() / ".cache" / "moetier" / "profiles" / f"{name_or_path}.json"
            path = user if user.exists() else PROFILE_DIR / f"{name_or_path}.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.json"))) or "none"
            raise ProfileError(f"no hardware profile {name_or_path!r}", hint=f"known profiles: {known}; "
                               "`moetier calibrate` measures this machine") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not valid JSON ({e})") from None

        def need(obj: dict, key: str, where: str):
            if key not in obj:
                raise ProfileError(f"{path}: missing field {where}{key}")
            return obj[key]

        def linear(key: str) -> Linear:
            obj = need(d, key, "")
            return Linear(float(need(obj, "per_token", key + ".")), float(need(obj, "fixed", key + ".")))

        link = need(d, "link", "")
        return cls(
            name=str(need(d, "name", "")), fast_tier_bytes=int(need(d, "fast_tier_bytes", "")),
            link=Link(float(need(link, "bandwidth_bytes_per_s", "link.")), float(link.get("latency_s", 0.0)),
                      float(link.get("utilisation", 1.0))),
            expert_compute=linear("expert_compute"), dense_s_per_layer=linear("dense_s_per_layer"),
            head_s=linear("head_s"), description=d.get("description", ""), sources=tuple(d.get("sources", ())),
            expert_bytes=int(d.get("expert_bytes", 0)),
            executor_s_per_layer=linear("executor_s_per_layer") if "executor_s_per_layer" in d else Linear(0.0, 0.0))
