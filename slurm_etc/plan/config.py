"""ParallelConfig and Layout: megatron-core's rank order tp-cp-ep-dp-pp (cp = ep = 1)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .model import ModelDesc


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """Data, tensor and pipeline parallel degrees, plus ZeRO-1 over dp.

    Rank order is megatron-core's default: ``rank = t + tp * (d + dp * p)``.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def mp(self) -> int:
        """Model-parallel classes: ranks that hold distinct (tp, pp) shards."""
        return self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(t, d, p) of a rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank(self, t: int, d: int, p: int) -> int:
        return t + self.tp * (d + self.dp * p)

    def mp_class(self, rank: int) -> int:
        """Index t + tp * p of the model-parallel shard a rank holds."""
        t, _, p = self.coords(rank)
        return t + self.tp * p

    def validate_for(self, model: ModelDesc, devices: int | None = None) -> None:
        """Raise ConfigError, with the numbers and the fix, if this cannot run ``model``."""
        tp, pp = self.tp, self.pp
        checks = [
            (model.num_heads, "num_attention_heads"),
            (model.query_groups, "num_query_groups"),
            (model.ffn_hidden, "ffn_hidden_size"),
            (model.padded_vocab, "padded vocab size"),
        ]
        for value, what in checks:
            if value % tp:
                raise ConfigError(f"tp ({tp}) must divide {what} ({value}) of {model.name}")
        if model.num_layers % pp:
            raise ConfigError(f"pp ({pp}) must divide num_layers ({model.num_layers}) of "
                              f"{model.name}; divisors: {_divisors(model.num_layers)}")
        if devices is not None and self.world != devices:
            raise ConfigError(f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world} "
                              f"must equal the devices ({devices})")

    def __str__(self) -> str:
        s = f"dp={self.dp},tp={self.tp},pp={self.pp}"
        return s + (",dist-opt" if self.distributed_optimizer else "")

    @classmethod
    def parse(cls, text: str, distributed_optimizer: bool = False) -> "ParallelConfig":
        """Parse ``dp=4,tp=2,pp=2`` (missing tp/pp default to 1)."""
        values: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            name, sep, raw = part.partition("=")
            if not sep or name not in ("dp", "tp", "pp"):
                raise ConfigError(f"cannot parse {text!r}: expected dp=N,tp=N,pp=N")
            if name in values:
                raise ConfigError(f"cannot parse {text!r}: {name} given twice")
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(f"cannot parse {text!r}: {name} must be an integer, "
                                  f"got {raw!r}") from None
        if "dp" not in values:
            raise ConfigError(f"cannot parse {text!r}: dp is required (dp=N,tp=N,pp=N)")
        return cls(distributed_optimizer=distributed_optimizer, **values)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class Layout:
    """A ParallelConfig plus the device each rank runs on (``devices[rank]``)."""

    config: ParallelConfig
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.devices) != self.config.world:
            raise ConfigError(f"layout {self.config} has {self.config.world} ranks but "
                              f"{len(self.devices)} devices")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"layout {self.config} places two ranks on one device")
