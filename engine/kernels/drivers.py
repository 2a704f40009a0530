"""One parallel gather driver per kernel variant, specialised per weight type on its row dot.

Every quantized type's GEMV has the same outer loop (``engine.kernels.dispatch``'s gather signature):
chunks of rows in parallel, the weights streamed with a prefetch ``ahead`` rows on, and per row the
type's dot product. Only the dot differs, so each loop is written once here as a plain Python
*template* whose upper-case globals (``_DOT``, ``_DOT4``) name the per-type functions, and
:func:`specialise` makes a fresh ``@njit`` copy of a template with those globals bound.

Why copies and not numba's other ways of passing a function: a dispatcher passed as an argument, or
closed over by a factory's inner function, keys numba's on-disk cache by a pickle of the dispatcher,
which holds a per-process uuid, so ``cache=True`` never hits (and each run adds cache files). A copy
with its own globals and its own name is cached like any module-level kernel: numba treats the bound
globals as compile-time constants (the dot is inlined or called exactly as in a hand-written copy, so
the machine code and the results are the same), and the cache file is named after the copy.

A copy's cache is stamped by this file (where its code is) and keyed by its bytecode, so editing a
template recompiles every copy; editing a bound dot elsewhere does not invalidate the copies that use
it, as with every kernel here that inlines another module's function: clear the cache (``*.nbi``,
``*.nbc``) after touching jitted code.
"""

from __future__ import annotations

import types as pytypes

from numba import njit, prange

from engine.kernels.simd import prefetch_array, prefetch_distance

CHUNK = 16  # rows per parallel work item

_NAMES: dict[str, tuple] = {}  # module.name -> (template, bound names)


def specialise(template, name: str, module: str, options: dict | None = None, **bound):
    """``@njit(cache=True, nogil=True, **options)`` of a copy of ``template`` named ``module.name``, its
    globals ``bound`` (the template's upper-case placeholders, every one of them) set to the given values.

    The copy sees the template module's globals as they are now (call this after the functions the
    template uses are defined). ``name`` must be unique per module (it names the copy's cache file)."""
    code = template.__code__
    wanted = {g for g in code.co_names if g.startswith("_") and g[1:2].isupper() and g.upper() == g}
    if set(bound) != wanted:
        raise TypeError(f"specialise({template.__name__}): bind exactly {sorted(wanted)}, got {sorted(bound)}")
    key = f"{module}.{name}"
    what = (template.__qualname__, tuple(sorted((k, getattr(v, "__name__", repr(v))) for k, v in bound.items())))
    if _NAMES.setdefault(key, what) != what:  # the same again (a module reloaded) is fine
        raise ValueError(f"specialise: {key} is {_NAMES[key]} already (the two would share a cache file)")
    fn = pytypes.FunctionType(code, {**template.__globals__, **bound}, name, template.__defaults__)
    fn.__qualname__ = name
    fn.__module__ = module
    fn.__doc__ = template.__doc__
    return njit(cache=True, nogil=True, **(options or {}))(fn)


# --- templates -------------------------------------------------------------------------------

_DOT = _DOT4 = None  # the templates' placeholders, bound per type by ``specialise``


def gemv_f(raw, d, rows, xi, X, out):
    """Exact-float gather GEMV: out[i, t] = _DOT(raw[rows[i]], d[rows[i]], X[xi[i] + t])."""
    M, T = out.shape
    ahead = prefetch_distance(raw)
    for c in prange((M + CHUNK - 1) // CHUNK):
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            j = i + ahead  # stream the weights: request row rows[j] now
            if j < M:
                prefetch_array(raw[rows[j]])
                prefetch_array(d[rows[j]])
            r = rows[i]
            for t in range(T):
                out[i, t] = _DOT(raw[r], d[r], X[xi[i] + t])


def gemv_f_sums(raw, d, rows, xi, X, Xs, out):
    """``gemv_f`` for the types whose dot also reads the activations' group sums Xs (Q2_K, Q4_K, Q5_K)."""
    M, T = out.shape
    ahead = prefetch_distance(raw)
    for c in prange((M + CHUNK - 1) // CHUNK):
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            j = i + ahead  # stream the weights: request row rows[j] now
            if j < M:
                prefetch_array(raw[rows[j]])
                prefetch_array(d[rows[j]])
            r = rows[i]
            for t in range(T):
                k = xi[i] + t
                out[i, t] = _DOT(raw[r], d[r], X[k], Xs[k])


def gemv_q8(raw, s, rows, xi, qa, da, bsums, out):
    """Q8-activation gather GEMV: decode tokens through _DOT (one row, one token), prefill tokens four
    at a time through _DOT4 (one row decoded once for four tokens). ``s``: the weights' scales;
    ``bsums``: the activations' code sums per block (asum of the 32-element types, bsums of the K-quants).

    The parameters keep the names the K-quant kernels had: numba passes a parfor's outlined body its
    variables in the order of their names, and with ``d``/``sums`` Q2_K's prefill measured 12 % slower
    (nothing else differed; the 32-element types are even either way)."""
    M, T = out.shape
    T4 = T - T % 4
    ahead = prefetch_distance(raw)
    for c in prange((M + CHUNK - 1) // CHUNK):
        for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
            j = i + ahead  # stream the weights: request row rows[j] now
            if j < M:
                prefetch_array(raw[rows[j]])
                prefetch_array(s[rows[j]])
            r = rows[i]
            k = xi[i]
            for t in range(T4, T):  # decode: the only pass, streaming the rows
                out[i, t] = _DOT(raw[r], s[r], qa[k + t], da[k + t], bsums[k + t])
        # Prefill: four tokens against every row of the chunk, then the next four, so the
        # tokens' activations and the chunk's rows both stay in L1.
        for t in range(0, T4, 4):
            for i in range(c * CHUNK, min(M, (c + 1) * CHUNK)):
                r = rows[i]
                k = xi[i]
                out[i, t], out[i, t + 1], out[i, t + 2], out[i, t + 3] = _DOT4(raw[r], s[r], qa, da, bsums, k + t)
