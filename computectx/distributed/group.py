"""Which ranks take part, and how they meet: the join before each collective call, and the
agreement on a check (``agree``) before anything changes."""

from __future__ import annotations

import contextlib
import datetime
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from computectx.distributed.collectives import all_reduce_on

__all__ = [
    "GroupArg",
    "agree",
    "check_join_timeout",
    "data_parallel_group",
    "describe_forward",
    "join",
    "join_forwards",
    "joined",
    "joining",
]

_T = TypeVar("_T")

GroupArg = dist.ProcessGroup | DeviceMesh | None
"""A process group, a one-dimensional ``DeviceMesh``, or ``None`` for the default group."""

_INIT_HINT = (
    "call torch.distributed.init_process_group(backend) first (or launch with torchrun / "
    "`computectx demo --nproc N`)"
)


def data_parallel_group(group: GroupArg = None) -> dist.ProcessGroup:
    """The process group to reduce over: ``group`` itself, a mesh's group, or the default one.

    Raises ``RuntimeError`` naming what to call when torch.distributed is not initialised,
    and ``TypeError``/``ValueError`` for anything but a group or a one-dimensional mesh.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"torch.distributed is not initialised: {_INIT_HINT}")
    if group is None:
        default = dist.group.WORLD
        if default is None:  # pragma: no cover - initialised implies a default group
            raise RuntimeError(f"torch.distributed has no default group: {_INIT_HINT}")
        return default
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a {group.ndim}-dimensional DeviceMesh {group.mesh_dim_names or ''} names no "
                f"single data-parallel group; pass mesh[dim_name] (one dimension) instead"
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(
        f"group must be a torch.distributed ProcessGroup, a one-dimensional DeviceMesh or "
        f"None (the default group), got {type(group).__name__}"
    )


# ----- Ranks agree before anyone raises ------------------------------------------------------

_RAISED = (ValueError, TypeError, RuntimeError)
_TYPES = {t.__name__: t for t in (*_RAISED, NotImplementedError)}


def _said(e: BaseException) -> str:
    """``str(e)``, or a stand-in where that raises: the message must cross to every rank."""
    try:
        return str(e)
    except Exception as err:  # a broken __str__ must not make this rank raise alone
        return f"<{type(e).__name__} whose message could not be read: {type(err).__name__}>"


def _kind(e: BaseException) -> str:
    """The name of the type every rank raises for ``e``: its own where it is one of
    ``_TYPES`` (NotImplementedError too), else the first of ``_RAISED`` it is (a library's
    ValueError subclass raises as ValueError), else ``RuntimeError``."""
    if type(e) in _TYPES.values():
        return type(e).__name__
    return next((t.__name__ for t in _RAISED if isinstance(e, t)), "RuntimeError")


def agree(
    check: Callable[[], _T],
    group: GroupArg = None,
    *,
    what: str,
    join_timeout: object = None,
) -> list[_T]:
    """Run the rank-local ``check`` on every rank of ``group`` and exchange the outcomes in one
    ``all_gather_object``: every rank's value, in rank order, when no rank raised; else the same
    error on every rank, promptly, naming the rank(s) that raised and each one's message.

    A setup check that can fail on one rank (a model built differently there, an argument parsed
    differently) would otherwise raise on that rank alone while the others wait in their next
    collective until the group's timeout. ``check`` must raise before it changes anything. The
    error is the first failing rank's ``ValueError``, ``TypeError`` or ``RuntimeError``
    (``NotImplementedError`` as itself, a subclass of one of those as that one, any other
    exception as a ``RuntimeError``), chained, on the ranks that raised, to their own exception.
    ``what`` names the call (``"expert_parallel"``) and is what the ranks join first (``join``,
    waiting at most ``join_timeout`` seconds; one that ``check_join_timeout`` refuses waits the
    group's timeout, and ``check`` refuses it on every rank): a rank that makes the call alone
    gets a ``RuntimeError`` naming the absent ranks instead of waiting in ``all_gather_object``,
    and ranks that meet from different calls (one in ``expert_parallel``, another already in
    ``parallelize``) all raise one naming each rank's call, instead of taking each other's
    outcome.
    """
    pg = data_parallel_group(group)
    try:
        check_join_timeout(join_timeout)
        wait = join_timeout if isinstance(join_timeout, int | float) else None
    except ValueError:
        wait = None
    join(pg, what, wait)
    mine: tuple[str, Any]
    own: BaseException | None = None
    try:
        mine = ("ok", check())
    except Exception as e:  # every kind crosses: a rank must never raise alone
        own = e
        kind = _kind(e)
        mine = (kind, _said(e) if kind == type(e).__name__ else f"{type(e).__name__}: {_said(e)}")
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, mine, group=pg)
    failed = [(r, kind, text) for r, (kind, text) in enumerate(everyone) if kind != "ok"]
    if not failed:
        return [value for _, value in everyone]
    ranks = ", ".join(str(r) for r, _, _ in failed)
    texts = {text for _, _, text in failed}
    why = (
        failed[0][2] if len(texts) == 1 else "; ".join(f"rank {r}: {text}" for r, _, text in failed)
    )
    error = _TYPES.get(failed[0][1], RuntimeError)
    raise error(
        f"{what} failed on rank(s) {ranks} of the group (every rank raises this): {why}"
    ) from own


def agree_ok(check: Callable[[], None], group: GroupArg = None, *, what: str) -> None:
    """``agree`` for a check that returns nothing, run where the ranks already joined the
    same call (``Parallel.step``): one 1-element all-reduce of the verdicts when every rank
    passes (about a join's cost; ``agree``'s ``all_gather_object`` is two all-gathers and a
    pickle, several times more), and only when some rank failed ``agree``'s exchange of the
    messages: the same error on every rank, naming the rank(s), promptly."""
    pg = data_parallel_group(group)
    try:
        check()
        failed = 0.0
    except Exception:  # every kind crosses, below
        failed = 1.0
    verdict = torch.tensor([failed])
    all_reduce_on(verdict, pg, dist.ReduceOp.MAX)  # a CPU tensor, as ShardedParams reduces
    if verdict.item() == 0.0:
        return
    # Some rank failed: every rank runs the check again inside agree, which exchanges the
    # messages (a check that raises before it changes anything raises alike again).
    agree(check, pg, what=what)
    raise RuntimeError(  # a check that passed on its second run on every rank
        f"{what}: a rank's check failed, then passed when run again; nothing changed"
    )


# ----- Ranks join a collective call before its first collective ------------------------------

_JOIN_PREFIX = "computectx/join/"


class _Join:
    """The rendezvous of one process group's collective calls (``join``), through the group's
    c10d store: attempt ``g`` (every rank counts its calls alike) holds a count ``n{g}``, a
    verdict ``go{g}`` and, per rank, ``{rank}`` = ``"{g}:{call}"``.

    A rank writes its call, adds one to the count; the rank that completes it compares the
    calls and sets the verdict (``ok``, or the calls that differ); the others wait for it, at
    most ``timeout``. A rank whose wait runs out sets the verdict ``abort`` instead: both are
    one ``compare_set`` on an empty key, so exactly one decision stands. Every rank that
    meets an aborted attempt without having decided it goes on to the next attempt (its call
    was in time; the abort was another's), so every rank skips the same attempts and the
    group stays usable.

    The store lives in global rank 0's process (``env://`` and ``tcp://`` groups): were it to
    leave a join as soon as the verdict stood and exit (a DDP step, the last of the run, has no
    collective after it), a rank still reading the verdict would meet a closed connection. So
    the other ranks count ``a{g}`` once they have read it, the last sets ``d{g}``, and rank 0
    waits for that before it returns (not after an abort: a rank that never came would not
    count)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        base = dist.distributed_c10d._get_process_group_store(group)
        self.store = dist.distributed_c10d.PrefixStore(_JOIN_PREFIX, base)
        # The store's timeout is the group's (init_process_group sets it so).
        wait = getattr(base, "timeout", None)
        self.default_timeout = (
            wait if isinstance(wait, datetime.timedelta) else datetime.timedelta(minutes=10)
        )
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.hosts = dist.get_rank() == 0  # the store's process (see the class's docstring)
        self.gen = 0
        self.depth = 0  # forwards of this group underway on this rank (join_forwards)

    def __call__(self, call: str, timeout: float | None, refusal: str | None = None) -> None:
        wait = self.default_timeout if timeout is None else datetime.timedelta(seconds=timeout)
        while True:
            verdict = self._attempt(call if refusal is None else f"{call}{_REFUSED}{refusal}", wait)
            if not verdict.startswith("abort:"):
                break  # an abort decided by another rank: this call goes on to the next
        if verdict != "ok":
            raise RuntimeError(verdict)

    def _attempt(self, call: str, wait: datetime.timedelta) -> str:
        g, s = self.gen, self.store
        self.gen = g + 1
        s.set(str(self.rank), f"{g}:{call}")
        if s.add(f"n{g}", 1) == self.world:
            got = s.compare_set(f"go{g}", "", self._compare(g)).decode()
            if g:  # every rank is past attempt g - 1
                for key in ("n", "go", "a", "d"):
                    s.delete_key(f"{key}{g - 1}")
        else:
            try:
                s.wait([f"go{g}"], wait)
            except dist.DistStoreError:
                mine = f"abort:{self.rank}"
                if s.compare_set(f"go{g}", "", mine).decode() == mine:
                    self._read(g, mine, wait)
                    raise RuntimeError(self._missing(g, call, wait)) from None
            got = s.get(f"go{g}").decode()
        self._read(g, got, wait)
        return got

    def _read(self, g: int, verdict: str, wait: datetime.timedelta) -> None:
        """This rank has read attempt ``g``'s verdict: rank 0 waits until every rank has."""
        s = self.store
        if not self.hosts:
            if s.add(f"a{g}", 1) == self.world - 1:
                s.set(f"d{g}", "")
        elif not verdict.startswith("abort:"):
            with contextlib.suppress(dist.DistStoreError):  # a rank that died after joining
                s.wait([f"d{g}"], wait)

    def _compare(self, g: int) -> str:
        keys = [str(r) for r in range(self.world)]
        got = [v.decode().split(":", 1)[1].partition(_REFUSED) for v in self.store.multi_get(keys)]
        calls, why = [c for c, _, _ in got], [w for _, _, w in got]
        if all(c == calls[0] for c in calls):
            ranks = ", ".join(str(r) for r, w in enumerate(why) if w)
            first = next((w for w in why if w), "")
            every = "of the group (every rank raises this)"
            return f"{calls[0]} failed on rank(s) {ranks} {every}: {first}" if ranks else "ok"
        listed = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        return (
            f"the ranks of the group entered different collective calls together ({listed}): "
            f"every rank must make the same calls in the same order; nothing was exchanged"
        )

    def _missing(self, g: int, call: str, wait: datetime.timedelta) -> str:
        s = self.store
        joined = [
            r
            for r in range(self.world)
            if s.check([str(r)]) and s.get(str(r)).decode().startswith(f"{g}:")
        ]
        absent = [r for r in range(self.world) if r not in joined]
        return (
            f"{call} on rank {self.rank}: rank(s) {', '.join(map(str, absent)) or 'none'} of "
            f"the group did not join it within {wait.total_seconds():g} s. It is a collective "
            f"call: every rank of the group must run it together, in the same order "
            f"(evaluation forwards included). Nothing was exchanged and the group is still "
            f"usable"
        )


# Weak: a destroyed group's join (and its store) goes with it, not at exit (std::terminate).
_JOINS: weakref.WeakKeyDictionary[dist.ProcessGroup, _Join] = weakref.WeakKeyDictionary()


def _join_of(group: dist.ProcessGroup) -> _Join:
    join = _JOINS.get(group)
    if join is None:
        join = _JOINS[group] = _Join(group)
    return join


JOIN_TIMEOUT_MAX = datetime.timedelta(days=999_999_999).total_seconds()
"""The longest ``join_timeout`` in seconds (~8.64e13): the longest ``datetime.timedelta``."""


def check_join_timeout(join_timeout: object) -> None:
    """A ``join_timeout`` argument: ``None`` (the group's timeout) or a number of seconds
    ``0 < t <= JOIN_TIMEOUT_MAX`` (``ValueError`` otherwise: a longer one would overflow the
    store's ``timedelta`` at every forward)."""
    if join_timeout is not None and (
        isinstance(join_timeout, bool)
        or not isinstance(join_timeout, int | float)
        or not 0 < join_timeout <= JOIN_TIMEOUT_MAX
    ):
        raise ValueError(
            f"join_timeout must be a number of seconds in (0, {JOIN_TIMEOUT_MAX:.6g}] (the "
            f"longest datetime.timedelta) or None (the group's timeout), got {join_timeout!r}"
        )


_REFUSED = "\x00refused\x00"  # a rank's call and, after it, why its own check refused it


@torch.compiler.disable  # type: ignore[untyped-decorator]
def join(
    group: dist.ProcessGroup, call: str, timeout: float | None = None, refusal: str | None = None
) -> None:
    """Wait until every rank of ``group`` has entered the collective call ``call`` (a short
    description: ``"forward (eval, grad off)"``), before its first collective: one
    ``RuntimeError`` on the ranks that came, naming the ranks that did not, when they do not
    all come within ``timeout`` seconds (``None``: the group's own timeout), instead of a
    hang in the call's first collective; one ``RuntimeError`` on every rank when the ranks
    entered different calls. A refused call exchanged nothing, and the next call that every
    rank makes together goes through (``_Join``). A few store round trips (docs/distributed.md
    measures them); nothing in a group of one. ``refusal``: this rank's check refused the call
    (the message): every rank raises one ``RuntimeError`` naming the ranks that refused and the
    first one's message, at once (the store only, no collective)."""
    j = _join_of(group)
    if j.world > 1:
        j(call, timeout, refusal)
    elif refusal is not None:
        raise RuntimeError(refusal)


def joined(group: dist.ProcessGroup) -> bool:
    """Whether a forward ``join_forwards`` joined over ``group`` is underway on this rank."""
    return (j := _JOINS.get(group)) is not None and j.depth > 0


def describe_forward(module: nn.Module) -> str:
    """What ``join`` compares for a forward of ``module``: its mode and autograd's."""
    grad = (
        "inference mode"
        if torch.is_inference_mode_enabled()
        else ("grad on" if torch.is_grad_enabled() else "grad off")
    )
    return f"forward of {type(module).__name__} ({'train' if module.training else 'eval'}, {grad})"


@contextlib.contextmanager
def joining(
    group: dist.ProcessGroup, call: str, timeout: float | None, refusal: str | None = None
) -> Iterator[None]:
    """Run a collective call's body after joining ``group`` (``join``, ``refusal`` with it),
    unless a call that joined it is already underway on this rank (``Parallel.step`` calling
    ``update_expert_bias``): one rendezvous per outermost call."""
    j = _join_of(group)
    if j.depth == 0:
        join(group, call, timeout, refusal)
    elif refusal is not None:
        raise RuntimeError(refusal)
    j.depth += 1
    try:
        yield
    finally:
        j.depth = max(0, j.depth - 1)


COMPILE_REFUSED = (
    "the forward of a model whose forwards are collectives (expert parallelism, FSDP2 under "
    "parallelize) first joins its group eagerly (store round trips), and an expert-parallel "
    "MoE routes with split sizes read on the host, so it cannot be one graph: compile with "
    "fullgraph=False (the join and the exchanges stay eager) or compile the blocks"
)
"""Why ``torch.compile(..., fullgraph=True)`` refuses such a model (dynamo shows it)."""


def join_forwards(module: nn.Module, group: dist.ProcessGroup, timeout: float | None) -> None:
    """Make every forward of ``module`` join ``group`` first (``join``), once however deeply
    its forwards nest: a forward pre-hook placed before any other (FSDP2's all-gather, DDP's)
    and a forward hook that runs whatever the forward raised. Both run eagerly (a compiled
    forward breaks its graph there; ``fullgraph=True`` names ``COMPILE_REFUSED``)."""
    j = _join_of(group)
    if j.world == 1:
        return

    @torch.compiler.disable(reason=COMPILE_REFUSED)  # type: ignore[untyped-decorator, no-untyped-call]
    def enter(m: nn.Module, args: Any) -> None:
        if j.depth == 0:
            join(group, describe_forward(m), timeout)
        j.depth += 1

    @torch.compiler.disable(reason=COMPILE_REFUSED)  # type: ignore[untyped-decorator, no-untyped-call]
    def leave(m: nn.Module, args: Any, out: Any) -> None:
        j.depth = max(0, j.depth - 1)

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)
