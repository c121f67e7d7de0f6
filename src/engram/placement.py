"""Where and in what precision a loaded model runs: `--dtype` and `--device` of every command that loads a model.

    dtype, device = check_placement("bfloat16", "cuda:1")   # one-line ValueError if torch cannot run it here
    place(model, dtype, device)                             # the dense weights in `dtype`, everything on `device`

`dtype` (`DTYPES`) is the precision of the *dense* weights (attention, MLP, embeddings, norms, the Engram layers'
projections and convolution, an adapter's and a LoRA's weights). The Engram tables keep the dtype of their rows
as saved (`EngramConfig.table_dtype`, float32 unless a model was built otherwise): each gather is cast to the
hidden states' dtype before it is used (`Engram.gated_value`), so float32 rows work under a bfloat16 model and
cost no precision. To hold the rows in another format too, `--table-format` (`tables.quant.set_table_format`:
bfloat16, int8, fp8) converts them; it is not repeated here. Buffers (rotary frequencies, MoE routing bias) are
left as the loader made them, as transformers' own `from_pretrained(dtype=...)` leaves them, and so are parameters
a transformers model keeps in float32 on purpose (`_keep_in_fp32_modules`).

None for either means "as loaded": float32 for an engram model, a transformers base in its checkpoint's dtype
(transformers' "auto"), a folder kind's own choice; on the CPU. That is what every loader did before these
options existed, so leaving them out changes nothing.

Half precision on a CPU runs, but matmuls are fast only where the CPU has native bfloat16 / float16 instructions
(AVX512-BF16, AMX): elsewhere torch emulates them and a forward is several times slower than float32, for half the
memory of the dense weights. `check_placement` says so in one warning (benchmarks/bench_dtype.py measures it).
"""

from __future__ import annotations

import warnings

import torch

from .memory import is_table_key

DTYPES = ("float32", "bfloat16", "float16")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WARNED: set = set()


def torch_dtype(dtype) -> torch.dtype | None:
    """The `torch.dtype` of `dtype` (a name in `DTYPES`, a `torch.dtype` among them, or None); ValueError otherwise."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in _TORCH.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _TORCH:
        return _TORCH[dtype.removeprefix("torch.")]
    raise ValueError(f"--dtype {dtype}: not a dtype engram runs models in (choose from {', '.join(DTYPES)})")


def torch_device(device) -> torch.device | None:
    """`device` (a string such as cpu, cuda, cuda:1, mps, or a `torch.device`) checked against what torch can use in
    this process; None stays None. A ValueError in one line otherwise (the CLI prints it as `engram: error: ...`)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {device}: not a device torch knows ({_first_line(e)}); give cpu, cuda, cuda:N "
                         "or mps") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError(f"--device {device}: the meta device holds no data; give cpu, cuda, cuda:N or mps")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}, "
                             f"{build}); leave --device out to run on the CPU")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"--device {device}: torch sees {n} CUDA device(s) here (cuda:0..cuda:{n - 1})")
        return dev
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"--device {device}: torch sees no MPS (Apple GPU) device here; leave --device out to run "
                         "on the CPU")
    try:  # any other backend torch was built with (xpu, ...): can it hold a tensor?
        torch.empty(1, device=dev)
    except Exception as e:  # (RuntimeError, AssertionError, ...: whatever a backend raises when it is not here)
        raise ValueError(f"--device {device}: torch cannot use it here ({_first_line(e)}); leave --device out to "
                         "run on the CPU") from None
    return dev


def check_placement(dtype=None, device=None) -> tuple[torch.dtype | None, torch.device | None]:
    """(torch dtype, torch device) of `--dtype`/`--device`, both checked before anything loads: a device torch
    cannot use here, or a dtype it cannot compute in on that device, is a one-line ValueError; half precision on a
    CPU without native instructions for it is a warning (it runs, slowly)."""
    dt, dev = torch_dtype(dtype), torch_device(device)
    if dt is None or dt == torch.float32:
        return dt, dev
    name = str(dt).removeprefix("torch.")
    if dev is not None and dev.type == "cuda":
        if dt == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"--dtype bfloat16: {torch.cuda.get_device_name(dev)} has no bfloat16 arithmetic; "
                             "use --dtype float16 or float32")
        return dt, dev
    if dev is None or dev.type == "cpu":
        if not _cpu_computes(dt):
            raise ValueError(f"--dtype {name}: this torch ({torch.__version__}) cannot multiply {name} matrices on "
                             "the CPU; use --dtype float32 (or bfloat16)")
        if not _cpu_native(dt) and dt not in _WARNED:  # (once a process: every loader checks)
            _WARNED.add(dt)
            isa = "AVX512-BF16 or AMX" if dt == torch.bfloat16 else "AVX512-FP16 or AMX-FP16"
            warnings.warn(f"--dtype {name} on this CPU: no native {name} matmuls ({isa}), so torch emulates them: it "
                          "runs slower than float32 and saves only memory (benchmarks/bench_dtype.py)", stacklevel=2)
    return dt, dev


def place(model, dtype=None, device=None):
    """`model` with its dense floating-point parameters in `dtype` (None: as they are) and all of it on `device`
    (None: where it is), in place; returns it. Engram tables (`memory.is_table_key`), buffers and a transformers
    model's `_keep_in_fp32_modules` are not cast (module doc). Parameters keep their identity, so tied weights
    (lm_head = embed_tokens) stay tied. A model whose weights it cast says so in `model.engram_cast_to` ("bfloat16")."""
    dt = torch_dtype(dtype)
    if dt is not None:
        keep, cast = _keep_fp32(model), False
        with torch.no_grad():
            for name, p in model.named_parameters():  # (each shared parameter once)
                if p.is_floating_point() and p.dtype != dt and not is_table_key(name) \
                        and not any(k in name.split(".") or f".{k}." in f".{name}." for k in keep):
                    p.data, p.grad, cast = p.data.to(dt), None, True
        if cast:  # (an overlay's digest is of the weights as saved: `inference.prepare_inference` names this)
            model.engram_cast_to = str(dt).removeprefix("torch.")
    if device is not None:
        model.to(torch_device(device))
    return model


def model_device(model) -> torch.device:
    """The device of `model`'s first parameter (the input ids go there): the CPU for a model without any."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def dense_dtype(model) -> torch.dtype | None:
    """The dtype of `model`'s dense weights (its first floating-point parameter that is no Engram table)."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not is_table_key(name):
            return p.dtype
    return None


def _keep_fp32(model) -> list[str]:
    keep = []
    for m in model.modules():
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            keep += list(getattr(m, attr, None) or [])
    return sorted(set(keep))


def _cpu_computes(dt: torch.dtype) -> bool:
    try:
        a = torch.ones(2, 2, dtype=dt)
        return bool((a @ a)[0, 0].item() == 2)
    except RuntimeError:
        return False


def _cpu_native(dt: torch.dtype) -> bool:
    """True where oneDNN has fast kernels for `dt` on this CPU (AVX512-BF16, AMX; ARM's BF16/FP16 extensions)."""
    try:
        check = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}[dt]
        return bool(check())
    except Exception:  # (a private probe: a torch without it says nothing, and no warning is given)
        return True


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
