"""ParallelConfig and Layout: megatron-core's rank order tp-cp-ep-dp-pp."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .model import ModelDesc

# The degrees a layout string names, in the order it prints them; dp is required.
DEGREE_NAMES = ("dp", "tp", "pp", "ep", "cp", "vpp")


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """Parallel degrees as megatron-core's ``initialize_model_parallel`` takes them, plus
    ZeRO-1 over dp (the distributed optimizer).

    Rank order is megatron-core's default ``tp-cp-ep-dp-pp``:
    ``rank = t + tp * (c + cp * (d + dp * p))`` for the dense part; the experts' rank
    generator (expert tensor parallelism = tp, cp = 1) reads the same ranks as
    ``t + tp * (e + ep * (x + edp * p))``, so the dense (c, d) pair and the expert (e, x) pair
    are two factorings of one index ``c + cp * d`` over ``dp * cp`` ranks.

    Attributes:
        dp: data-parallel degree (not counting cp).
        tp: tensor-parallel degree (the experts' tensor parallelism too).
        pp: pipeline-parallel degree.
        distributed_optimizer: optimizer state sharded over dp x cp (ZeRO-1).
        ep: expert-parallel degree; divides dp x cp (the expert data-parallel degree is
            dp x cp / ep).
        cp: context-parallel degree: each sequence is split over cp ranks; parameters are
            replicated over cp.
        vpp: virtual pipeline chunks per pipeline rank (the interleaved schedule).
    """

    dp: int
    tp: int = 1
    pp: int = 1
    distributed_optimizer: bool = False
    ep: int = 1
    cp: int = 1
    vpp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"ep ({self.ep}) must divide dp x cp ({self.dp} x {self.cp} = "
                              f"{self.dp * self.cp}): experts are sharded over the "
                              "data-parallel ranks")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(f"vpp ({self.vpp}) needs pp > 1: megatron-core's interleaved "
                              "schedule runs only with pipeline parallelism")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def mp(self) -> int:
        """Model-parallel classes: ranks that hold distinct dense (tp, pp) shards."""
        return self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same dense shard: the distributed optimizer shards over them."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel degree: ranks that hold the same expert shard."""
        return self.dp_cp // self.ep

    # -- the planner's holding classes ---------------------------------------------------
    # A rank is (class, replica): class ``t + tp * (e + ep * p)`` says which shards it holds
    # (dense state: its (t, p); experts: also its ep rank e), replica ``x`` (the expert
    # data-parallel index, ``(c + cp * d) // ep``) which copy. Then
    # ``rank = cls % class_width + class_width * (x + replicas * (cls // class_width))``
    # is megatron-core's rank, and with ep = cp = 1 class and replica are (t + tp * p, d).

    @property
    def class_width(self) -> int:
        """Holding classes per pipeline rank: tp x ep."""
        return self.tp * self.ep

    @property
    def classes(self) -> int:
        """Holding classes: tp x ep x pp."""
        return self.class_width * self.pp

    @property
    def replicas(self) -> int:
        """Ranks per holding class: dp x cp / ep (the expert data-parallel degree)."""
        return self.expert_dp

    def rank_of(self, cls: int, replica: int) -> int:
        w = self.class_width
        return cls % w + w * (replica + self.replicas * (cls // w))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(t, d, p) of a rank (its cp coordinate is :meth:`cp_rank`)."""
        t, _, d, p = self.coords4(rank)
        return t, d, p

    def coords4(self, rank: int) -> tuple[int, int, int, int]:
        """(t, c, d, p) of a rank in the order tp-cp-dp-pp."""
        t, rest = rank % self.tp, rank // self.tp
        c, rest = rest % self.cp, rest // self.cp
        return t, c, rest % self.dp, rest // self.dp

    def rank(self, t: int, d: int, p: int, c: int = 0) -> int:
        return t + self.tp * (c + self.cp * (d + self.dp * p))

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def dp_cp_rank(self, rank: int) -> int:
        """Index ``c + cp * d`` among the dp x cp ranks holding the same dense shard."""
        return (rank // self.tp) % self.dp_cp

    def ep_rank(self, rank: int) -> int:
        """The expert-parallel rank: which slice of the experts a rank holds."""
        return self.dp_cp_rank(rank) % self.ep

    def expert_dp_rank(self, rank: int) -> int:
        """Index among the expert_dp ranks holding the same expert shard."""
        return self.dp_cp_rank(rank) // self.ep

    def validate_for(self, model: ModelDesc, devices: int | None = None) -> None:
        """Raise ConfigError, one line with the numbers and the fix, if this cannot run
        ``model`` (megatron-core's own rules for tp, pp, vpp, cp and ep)."""
        tp, pp = self.tp, self.pp
        checks = [
            (model.num_heads, "num_attention_heads"),
            (model.query_groups, "num_query_groups"),
            (model.padded_vocab, "padded vocab size"),
        ]
        if not model.moe:
            checks.insert(2, (model.ffn_hidden, "ffn_hidden_size"))
        else:
            checks.append((model.expert_ffn_size,
                           "expert ffn size (expert tensor parallelism = tp)"))
            if model.shared_expert_ffn:
                checks.append((model.shared_expert_ffn, "shared expert ffn size"))
        for value, what in checks:
            if value % tp:
                raise ConfigError(f"tp ({tp}) must divide {what} ({value}) of {model.name}")
        if model.num_layers % pp:
            raise ConfigError(f"pp ({pp}) must divide num_layers ({model.num_layers}) of "
                              f"{model.name}; divisors: {_divisors(model.num_layers)}")
        if model.num_layers % (pp * self.vpp):
            raise ConfigError(f"pp x vpp ({pp} x {self.vpp} = {pp * self.vpp}) must divide "
                              f"num_layers ({model.num_layers}) of {model.name}: each pipeline "
                              "rank holds vpp chunks of equal layers")
        if self.cp > 1 and model.seq_length % (2 * self.cp):
            raise ConfigError(f"2 x cp (2 x {self.cp} = {2 * self.cp}) must divide seq_length "
                              f"({model.seq_length}) of {model.name}: megatron splits each "
                              "sequence into 2 x cp chunks for causal load balance")
        if self.ep > 1 and not model.moe:
            raise ConfigError(f"ep ({self.ep}) needs a mixture-of-experts model; {model.name} "
                              "has no experts")
        if model.num_experts is not None and model.num_experts % self.ep:
            raise ConfigError(f"ep ({self.ep}) must divide num_experts ({model.num_experts}) "
                              f"of {model.name}; divisors: {_divisors(model.num_experts)}")
        if devices is not None and self.world != devices:
            raise ConfigError(f"{self.product_text()} = {self.world} must equal the devices "
                              f"({devices})")

    def product_text(self) -> str:
        """``dp*tp*pp = 2*2*1`` (with ``*cp`` when cp > 1): how the world is made."""
        names, values = ["dp", "tp", "pp"], [self.dp, self.tp, self.pp]
        if self.cp > 1:
            names.append("cp")
            values.append(self.cp)
        return f"{'*'.join(names)} = {'*'.join(map(str, values))}"

    def degrees(self) -> str:
        """The layout string without the optimizer: ``dp=4,tp=1,pp=2,ep=2,vpp=2``; degrees
        that are 1 beyond dp/tp/pp are left out, so older strings read the same."""
        s = f"dp={self.dp},tp={self.tp},pp={self.pp}"
        for name in ("ep", "cp", "vpp"):
            if getattr(self, name) > 1:
                s += f",{name}={getattr(self, name)}"
        return s

    def __str__(self) -> str:
        return self.degrees() + (",dist-opt" if self.distributed_optimizer else "")

    @classmethod
    def parse(cls, text: str, distributed_optimizer: bool = False) -> "ParallelConfig":
        """Parse ``dp=4,tp=2,pp=2,ep=2,cp=1,vpp=2`` (any degree but dp defaults to 1)."""
        expected = ",".join(f"{n}=N" for n in DEGREE_NAMES)
        values: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            name, sep, raw = part.partition("=")
            if not sep or name not in DEGREE_NAMES:
                raise ConfigError(f"cannot parse {text!r}: expected {expected}")
            if name in values:
                raise ConfigError(f"cannot parse {text!r}: {name} given twice")
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(f"cannot parse {text!r}: {name} must be an integer, "
                                  f"got {raw!r}") from None
        if "dp" not in values:
            raise ConfigError(f"cannot parse {text!r}: dp is required ({expected})")
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
