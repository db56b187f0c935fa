"""A device measured for the planner: :func:`measure` makes a :class:`DeviceProfile`.

It times small compiled programs: the matrix products' and an elementwise pass's rates, and,
where the device has pinned host memory (not a CPU), the link as a plan's programs use it: a
scan writing its slices into a donated pinned buffer and one reading them back a slice ahead
(the rates), both in one program (``duplex``), and a scan of matrix products with and without
the copies beside them (the hidden shares, by the cost model's own law). The arithmetic from
times to a profile's fields is pure (:func:`_link_fields`), apart from the programs that time.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

from residual_store._src.errors import InvalidArgumentError, ResidualStoreError
from residual_store._src.plan.profile import DeviceProfile

__all__ = ["LinkTimes", "measure"]


def measure(device: Any, size: int = 1024, repeats: int = 3) -> DeviceProfile:
    """Measures ``device``, each program the best of ``repeats`` runs after one that compiles
    and warms it:

    * ``matmul_flops``: products of ``size``-square bf16 matrices, and ``memory_bytes``: an
      elementwise pass over ``64 * size**2`` float32 values, each in a loop whose count is an
      argument (one program), from the time the loop's steps add (:func:`_per_step`: what
      launching a program costs left out; a TPU v5e spends most of a millisecond on it);

    where the device has a ``pinned_host`` memory kind apart from its own (not a CPU), its
    link, through the path a plan's programs take (:class:`_Link`, :func:`_link_fields`), on
    stacks of :data:`_ITERATIONS` slices of ``4 * size`` by ``size`` bf16 values (8 MiB at
    ``size=1024``), a slice an iteration of a ``lax.scan``:

    * ``d2h_bytes``: a compiled program that writes them into a pinned buffer it is handed,
      donated (a planned forward's offload of a scan's stacks: :mod:`residual_store._src.scratch`);
    * ``h2d_bytes``: one that reads them from pinned memory, the next slice while the current
      one is used (a planned backward's: :mod:`residual_store._src.lazy`);
    * ``duplex``: both in one program against each alone (:func:`_duplex`);
    * ``hidden_forward`` / ``hidden_backward``: a scan of matrix products whose iteration
      computes for about its copy's time, run keeping its slices on the device and copying them
      (to host memory, from it); the copy time the compute hid, over the compute's time, is the
      share of the cost model's law (:func:`_hidden_share`).

    The link's times leave out what launching a program costs (a program that does nothing,
    timed alike). Without a link, 2 programs to compile; with one, 10, whose runs
    take about half a second on a TPU v5e: there (JAX 0.10.2, two runs) the whole took 9.6 and
    10.0 s, most of it compiling, and gave 167-176 TFLOP/s, 13.7-13.8 GB/s to host and 12.8
    GB/s back, duplex, shares 0.91-0.93 and 0.94 (the built-in: 165 TFLOP/s, 13.4 and 14 GB/s,
    2/3 and 0.9); the pass measured here ran at 687 GB/s in a probe of its own (the chip's peak
    is 819). (A forward here copies each iteration's carry beside all of the iteration's
    compute, as a plan offloads a scan's carries; the built-in 2/3 is a model's forward, some
    of whose values are made late in an iteration.) Each link program is given every placement
    and compiled and checked before it runs (a pinned buffer handed where device memory is
    expected aborts the process on a TPU, raising nothing: :func:`_checked`).
    """
    from residual_store._src.scratch import pinned_sharding

    flops, memory = _compute_rates(device, size, repeats)
    kind = str(device.device_kind)
    if device.platform == "cpu" or pinned_sharding(device) is None:
        return DeviceProfile(kind=kind, matmul_flops=flops, memory_bytes=memory)
    return DeviceProfile(kind=kind, matmul_flops=flops, memory_bytes=memory,
                         **_link_fields(_link_times(device, size, repeats, flops)))


def _compute_rates(device: Any, size: int, repeats: int) -> tuple[float, float]:
    """``device``'s matrix products' FLOP/s and an elementwise pass's bytes/s (:func:`measure`)."""
    import jax
    import jax.numpy as jnp

    here = jax.sharding.SingleDeviceSharding(device)
    a = jax.device_put(jnp.full((size, size), 1.0 / size, jnp.bfloat16), here)
    x = jax.device_put(jnp.ones((64, size, size), jnp.float32), here)
    products = jax.jit(lambda a, count: jax.lax.fori_loop(0, count, lambda _, b: b @ a, a))
    # (a pass reads and writes every value once, as a fused elementwise operation does; on a TPU
    # v5e: reversed 687 GB/s, plain 656, rolled 340 (a roll is two slices, not one stream))
    passes = jax.jit(lambda x, count: jax.lax.fori_loop(0, count, lambda _, y: jnp.flip(y, 0) * 0.5 + 1.0, x))
    flops = 2 * size**3 / _per_step(lambda count: jax.block_until_ready(products(a, count)), repeats)
    memory = 2 * x.nbytes / _per_step(lambda count: jax.block_until_ready(passes(x, count)), repeats)
    return flops, memory


_ITERATIONS = 16  # a link program's scan: slices copied, one an iteration
_MAX_PRODUCTS = 64  # the most matrix products an iteration of a hidden-share program runs
_DUPLEX = 0.75  # both ways in one program within this share of one way then the other: duplex
_LONG = 0.004  # seconds: a loop of _per_step runs at least this long (where _MAX_STEPS allow)
_MAX_STEPS = 4096


def _best(run: Any, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``run()`` (which waits for what it started) in
    seconds, after one to compile and warm it."""
    run()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)


def _per_step(run: Any, repeats: int) -> float:
    """Seconds a step of ``run(count)`` takes (a program looping ``count`` times, the count an
    argument: compiled once): the count grows fourfold from 1 until a run takes :data:`_LONG`
    (or :data:`_MAX_STEPS`), then :func:`_slope` against twice the count."""
    count = 1
    while True:
        once = _best(lambda: run(count), repeats)
        if once >= _LONG or count >= _MAX_STEPS:
            break
        count *= 4
    return _slope(count, once, _best(lambda: run(2 * count), repeats))


def _slope(count: int, once: float, twice: float) -> float:
    """Seconds a step from the times of ``count`` and ``2 * count`` steps: what the second
    ``count`` steps added (launching the program and waiting for it cost both runs the same),
    or where noise made that nothing, the mean of the longer run's."""
    added = twice - once
    return added / count if added > 0 else twice / (2 * count)


@dataclasses.dataclass(frozen=True)
class LinkTimes:
    """Seconds of the link's measurement programs (best runs, :class:`_Link`), and their sizes.

    Attributes:
      nbytes: the bytes each program copies (each way).
      launch: a program that does nothing: what launching one and waiting for it costs, which
        every time below includes and :func:`_link_fields` leaves out.
      out: writing them into a donated pinned buffer, a slice an iteration, nothing else.
      back: reading them from pinned memory, a slice an iteration (the next one fetched ahead).
      both: both in one program.
      kept_forward: the forward's scan of matrix products, keeping its slices on the device.
      offloaded_forward: the same writing them into a donated pinned buffer instead.
      kept_backward: the backward's scan of matrix products reading its slices from the device.
      offloaded_backward: the same reading them from pinned memory, a slice ahead.
      products: the matrix products an iteration of the last four runs.
    """

    nbytes: int
    launch: float
    out: float
    back: float
    both: float
    kept_forward: float
    offloaded_forward: float
    kept_backward: float
    offloaded_backward: float
    products: int = 1


def _hidden_share(copy: float, kept: float, offloaded: float) -> float:
    """The cost model's share (:func:`residual_store._src.plan.cost.copy_seconds`) from three
    times: ``copy`` seconds of copying alone, ``kept`` of the compute beside it (the program
    keeping its values on the device), ``offloaded`` of the compute with the copy.

    The copy adds ``offloaded - kept``; the rest of it, ``copy - (offloaded - kept)``, hid. At the
    ratio ``r = kept / copy`` the law hides ``min(1, r * share)`` of the copy, so the share is
    the hidden seconds over the copy's, over ``r``: hidden over ``kept``, in [0, 1]. (Where all
    of the copy hid, that is ``1 / r``, a lower bound: the programs run at ``r`` about 1.)"""
    hidden = copy - (offloaded - kept)
    if not math.isfinite(hidden) or kept <= 0:
        return 0.0
    return min(1.0, max(0.0, hidden / kept))


def _duplex(out: float, back: float, both: float) -> bool:
    """Whether a link moves both ways at once: a program copying each way took at most
    :data:`_DUPLEX` of the two ways' times one after the other (1 for a link that takes turns,
    about a half for one that does not: on a TPU v5e 83 ms against 74 and 77)."""
    return both <= _DUPLEX * (out + back)


def _link_fields(times: LinkTimes) -> dict[str, Any]:
    """The profile's link fields from the measurement programs' times, less the launch's
    (:func:`_less_launch`)."""
    def run(t: float) -> float:
        return _less_launch(t, times.launch)

    out, back = run(times.out), run(times.back)
    return {
        "d2h_bytes": times.nbytes / out,
        "h2d_bytes": times.nbytes / back,
        "duplex": _duplex(out, back, run(times.both)),
        "hidden_forward": _hidden_share(out, run(times.kept_forward), run(times.offloaded_forward)),
        "hidden_backward": _hidden_share(back, run(times.kept_backward), run(times.offloaded_backward)),
    }


def _less_launch(t: float, launch: float) -> float:
    """A program's time ``t`` less ``launch`` (what launching one and waiting for it costs),
    kept above a tenth of ``t`` (noise can make the launch seem to take it all)."""
    return max(t - launch, t / 10)


def _products(copy: float, flops: float, flop: float) -> int:
    """How many matrix products of ``flop`` FLOPs each (at ``flops``) take about ``copy`` seconds."""
    return max(1, min(_MAX_PRODUCTS, round(copy * flops / flop)))


def _checked(jitted: Any, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
    """``jitted`` compiled for ``args``, refused (an exception, not a run that aborts the
    process) unless it places its inputs in the memory kinds of ``args`` and its outputs in
    those of ``outs`` (shardings), and every input it aliases with an output (a donated buffer
    it reuses) is in that output's memory kind: a pinned buffer handed to a program that
    expects device memory, or given to a device output, is what aborts."""
    import jax

    compiled = jitted.lower(*args).compile()
    ins = [s.memory_kind for s in jax.tree.leaves(compiled.input_shardings[0])]
    got = [s.memory_kind for s in jax.tree.leaves(compiled.output_shardings)]
    want = [s.memory_kind for s in outs]
    aliases = _aliases(compiled.as_text())
    if ins != [a.sharding.memory_kind for a in args] or got != want or any(
        o >= len(got) or i >= len(ins) or got[o] != ins[i] for o, i in aliases
    ):
        raise ResidualStoreError(f"a profile's measurement program places its inputs in {ins} and its outputs in "
                                 f"{got} (aliased {aliases}), not {want}")
    return compiled


def _aliases(hlo: str) -> list[tuple[int, int]]:
    """(output, input) pairs of a compiled program's text that share a buffer (its
    ``input_output_alias``: ``{1}: (2, {}, may-alias)`` gives output 1 input 2's buffer)."""
    head = hlo.split("input_output_alias={", 1)
    if len(head) < 2:
        return []
    depth, end = 1, 0
    for end, c in enumerate(head[1]):  # to the brace that closes the map
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            break
    found = re.findall(r"\{(\d*)\}:\s*\((\d+),", head[1][:end])
    return [(int(o or 0), int(i)) for o, i in found]


def _link_times(device: Any, size: int, repeats: int, flops: float) -> LinkTimes:
    """Times the programs of :func:`measure` on ``device`` (one with ``pinned_host`` memory,
    :class:`_Link`); the hidden shares' programs run beside each slice's copy as many products
    as take its time at ``flops`` (:func:`_products`)."""
    import jax

    link = _Link(device, size)
    tiny = jax.device_put(jax.numpy.zeros((), jax.numpy.float32), link.here)
    nothing = jax.jit(lambda t: t + 1)
    launch = _best(lambda: jax.block_until_ready(nothing(tiny)), repeats)
    out = link.time("out", repeats)
    k = _products(_less_launch(out, launch) / _ITERATIONS, flops, link.product_flop)
    return LinkTimes(nbytes=link.nbytes, launch=launch, out=out, back=link.time("back", repeats),
                     both=link.time("both", repeats), kept_forward=link.time("kept_forward", repeats, k),
                     offloaded_forward=link.time("offloaded_forward", repeats, k),
                     kept_backward=link.time("kept_backward", repeats, k),
                     offloaded_backward=link.time("offloaded_backward", repeats, k), products=k)


class _Link:
    """The link's measurement programs on one device with ``pinned_host`` memory: stacks of
    :data:`_ITERATIONS` bf16 slices of ``4 * size`` by ``size``, each program a ``lax.scan`` that
    copies a slice an iteration as a plan's programs do, through the library's own moves
    (:func:`residual_store._src.lazy.to_host`, ``to_device``): the forward's into a pinned
    buffer it is handed, donated (:mod:`residual_store._src.remat`), the backward's reading the
    next iteration's slice while this one is used (:mod:`residual_store._src.lazy`).

    Programs (:data:`NAMES`), where ``w`` is a ``size``-square matrix of means (a product by it
    keeps the values where they are) and an iteration's compute is ``k`` products by it:

    * ``out``: (w, h, buffer) -> (h, buffer): each iteration's carry ``h`` into the buffer (then
      ``h + 1``);
    * ``back``: (w, g, host stack) -> g, adding each slice to ``g``;
    * ``both``: (w, h, buffer, host stack) -> (buffer, g): the two at once;
    * ``kept_forward``: (w, h) -> (h, stack): ``h`` times ``w`` ``k`` times an iteration, each
      iteration's carry stacked on the device (a layer's input, which the compute runs beside);
      ``offloaded_forward``: (w, h, buffer) -> (h, buffer), stacked into the buffer;
    * ``kept_backward``: (w, g, stack) -> g: ``g + slice`` times ``w`` ``k`` times an
      iteration; ``offloaded_backward``: the same reading a host stack.

    Every program is given every placement and compiled and checked before it runs
    (:func:`_checked`); no device output has the donated buffer's shape.
    """

    NAMES = ("out", "back", "both", "kept_forward", "offloaded_forward", "kept_backward", "offloaded_backward")

    def __init__(self, device: Any, size: int) -> None:
        import jax
        import jax.numpy as jnp

        from residual_store._src.scratch import pinned_sharding

        host = pinned_sharding(device)
        if host is None:
            raise InvalidArgumentError(f"{device} has no pinned_host memory to measure a link to")
        self.host = host
        self.here = jax.sharding.SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
        rows = 4 * size
        self.w = jax.device_put(jnp.full((size, size), 1.0 / size, jnp.bfloat16), self.here)
        self.h = jax.device_put(jnp.full((rows, size), 1.0 / size, jnp.bfloat16), self.here)
        self.stack = jax.device_put(jnp.full((_ITERATIONS, rows, size), 1.0 / size, jnp.bfloat16), self.here)
        self.on_host = jax.device_put(self.stack, host)
        self.buffer = jax.device_put(jnp.zeros((_ITERATIONS, rows, size), jnp.bfloat16), host)  # donated, replaced
        self.nbytes = int(self.stack.nbytes)
        self.product_flop = 2.0 * rows * size * size

    def _parts(self, name: str, k: int) -> tuple[Any, tuple[Any, ...], tuple[Any, ...], int | None]:
        """``name``'s function, arguments (the buffer as ``None``), output placements and the
        output that gives the donated buffer (argument 2) back, or ``None``."""
        import jax
        import jax.numpy as jnp

        from residual_store._src.lazy import to_device, to_host

        n, last = _ITERATIONS, _ITERATIONS - 1
        here, host = self.here, self.host

        def chain(h: Any, w: Any) -> Any:
            for _ in range(k):
                h = h @ w
            return h

        def fetch(src: Any, i: Any) -> Any:  # slice i of a stack in host memory, on the device
            return to_device(jax.lax.dynamic_index_in_dim(src, i, 0, keepdims=False))

        def offload(w: Any, h: Any, buf: Any) -> tuple[Any, Any]:
            def step(carry: tuple[Any, Any], i: Any) -> tuple[tuple[Any, Any], None]:
                h, buf = carry  # the iteration's carry leaves while its compute runs
                buf = jax.lax.dynamic_update_index_in_dim(buf, to_host(h), i, 0)
                return (chain(h, w) if k else h + 1, buf), None
            return jax.lax.scan(step, (h, buf), jnp.arange(n))[0]

        def keep(w: Any, h: Any) -> tuple[Any, Any]:
            return jax.lax.scan(lambda h, _: (chain(h, w), h), h, None, length=n)

        def read(w: Any, g: Any, src: Any) -> Any:
            def step(carry: tuple[Any, Any, Any], _: Any) -> tuple[tuple[Any, Any, Any], None]:
                g, i, now = carry  # now: slice i, fetched an iteration ahead
                return (chain(g + now, w), i + 1, fetch(src, jnp.minimum(i + 1, last))), None
            return jax.lax.scan(step, (g, 0, fetch(src, 0)), None, length=n)[0][0]

        def read_device(w: Any, g: Any, src: Any) -> Any:
            return jax.lax.scan(lambda g, s: (chain(g + s, w), None), g, src)[0]

        def both(w: Any, h: Any, buf: Any, src: Any) -> tuple[Any, Any]:
            def step(carry: tuple[Any, ...], _: Any) -> tuple[tuple[Any, ...], None]:
                h, buf, g, i, now = carry
                buf = jax.lax.dynamic_update_index_in_dim(buf, to_host(h), i, 0)
                return (h + 1, buf, g + now, i + 1, fetch(src, jnp.minimum(i + 1, last))), None
            _, buf, g, _, _ = jax.lax.scan(step, (h, buf, h, 0, fetch(src, 0)), None, length=n)[0]
            return buf, g

        w, h = self.w, self.h
        parts: dict[str, tuple[Any, tuple[Any, ...], tuple[Any, ...], int | None]] = {
            "out": (offload, (w, h, None), (here, host), 1),
            "back": (read, (w, h, self.on_host), (here,), None),
            "both": (both, (w, h, None, self.on_host), (host, here), 0),
            "kept_forward": (keep, (w, h), (here, here), None),
            "offloaded_forward": (offload, (w, h, None), (here, host), 1),
            "kept_backward": (read_device, (w, h, self.stack), (here,), None),
            "offloaded_backward": (read, (w, h, self.on_host), (here,), None),
        }
        return parts[name]

    def program(self, name: str, k: int = 0) -> Any:
        """A callable that runs program ``name`` once and returns its outputs (``k`` products an
        iteration for the four hidden shares' programs; ``out``, ``back`` and ``both`` run
        none); a program that takes the donated buffer takes the last run's."""
        import jax

        fn, args, outs, buffer_out = self._parts(name, k if name.startswith(("kept", "offloaded")) else 0)
        args = tuple(self.buffer if a is None else a for a in args)
        jitted = jax.jit(fn, in_shardings=tuple(a.sharding for a in args), out_shardings=outs if len(outs) > 1 else outs[0],
                         donate_argnums=() if buffer_out is None else (2,), keep_unused=True)
        compiled = _checked(jitted, args, outs)

        def run() -> Any:
            if buffer_out is None:
                return compiled(*args)
            got = compiled(*args[:2], self.buffer, *args[3:])
            self.buffer = got[buffer_out]
            return got
        return run

    def time(self, name: str, repeats: int, k: int = 0) -> float:
        """The best of ``repeats`` runs of program ``name`` in seconds (:func:`_best`)."""
        import jax

        run = self.program(name, k)
        return _best(lambda: jax.block_until_ready(run()), repeats)
