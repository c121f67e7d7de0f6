"""lm-evaluation-harness's model class for engram: `--model engram`, any folder `engram.inference` loads.

    python -m engram.integrations.lm_eval --model engram --model_args path=runs/tiny --tasks hellaswag
    python -m engram.integrations.lm_eval --model engram --model_args base=bases/llama,adapter=runs/adapt ...

    import engram.integrations.lm_eval, lm_eval              # (the import registers "engram")
    lm_eval.simple_evaluate(model="engram", model_args={"path": "runs/tiny"}, tasks=[...])

Why `python -m engram.integrations.lm_eval` and not the bare `lm_eval` command: lm-eval 0.4 finds a model class
only in its own registry (`lm_eval.api.registry`, filled by `lm_eval/models/__init__.py` and by modules that call
`register_model` when imported); it reads no entry points and has no option to import a package (upstream issues
#1457, #3282). This module registers "engram" when imported, and run as a program it is lm-eval's own CLI
(`lm_eval.__main__.cli_evaluate`, every flag as `lm_eval` takes it) with "engram" registered. It registers a
"module:Class" path, as lm-eval's own models are, so running it as `__main__` and importing it name one class.

Scoring: log-softmax of the model's logits in float32, a continuation's tokens scored after its context in one
forward (sequences of a batch right-padded: the models are causal, so padding after a sequence changes none of its
logits); generation greedy (lm-eval's tasks ask for it), ended at EOS or a stop string. The tokenizer is the
model's own (`tokenizers`), with no BOS: lm-eval's empty-context prefix is the EOS, as engram's server tells
lm-eval's remote tokenizer (`engram serve`'s /tokenizer_info), so the two paths score the same tokens.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (lm-eval's own models register first: its registry imports them only if empty)
from lm_eval.api.model import TemplateLM

from ..errors import EngramError

NAME = "engram"


class LMEvalError(EngramError, ValueError):
    """Bad `--model_args` for `--model engram`: the message names the argument and the fix."""


class EngramLM(TemplateLM):
    """An engram model for lm-eval: `path` (a run dir, an engram model folder, any folder kind
    `load_inference_model` takes) or `base` + `adapter` (a pretrained base with its Engram adapter or LoRA);
    `overlay`: a fact overlay folder applied to every request; `table_tier`/`table_dir`, `dtype`, `device`: as
    `engram serve`'s flags. `batch_size`: sequences per forward; `max_length`: tokens a sequence may hold (default:
    the model's context); `max_gen_toks`: generate_until's default budget."""

    def __init__(self, path=None, base=None, adapter=None, overlay=None, table_tier: str = "ram", table_dir=None,
                 dtype=None, device=None, batch_size=1, max_batch_size=None, max_length=None, max_gen_toks=256,
                 **unused):
        super().__init__()
        from ..inference import load_inference_model, prepare_inference

        if (path is None) == (base is None):
            raise LMEvalError("--model engram: give --model_args path=DIR (a run dir or model folder) or "
                              "base=DIR,adapter=DIR")
        if unused:
            raise LMEvalError(f"--model engram: unknown model_args {', '.join(sorted(unused))} (it takes path, base, "
                              "adapter, overlay, table_tier, table_dir, dtype, device, max_length, max_gen_toks)")
        try:
            self.batch = int(batch_size or 1)
        except (TypeError, ValueError):
            raise LMEvalError(f"--batch_size {batch_size!r}: give a number of sequences per forward (--model engram "
                              "has no 'auto')") from None
        device = _usable(device)
        self.model, self.tok = load_inference_model(path, base, adapter, table_tier, table_dir, dtype=dtype,
                                                    device=device)
        if overlay is not None:
            prepare_inference(self.model, overlays={"overlay": overlay}, apply=True)
        self.model.eval()
        from ..adapters import generation_pad_id
        from ..placement import model_device

        self._device = model_device(self.model)
        self.pad_id = generation_pad_id(self.model)
        from ..tokenizer import model_eos_id

        self.eos = model_eos_id(self.model, self.tok)  # (the server's rule too)
        context = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self._max_length = int(max_length or context)
        self.max_gen_toks = int(max_gen_toks)

    # ---- what lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self.eos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=False).ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    # ---- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding yields it) per request
        ((context, continuation) text or None, context ids, continuation ids); a sequence longer than
        `max_length` loses the start of its context."""
        import torch
        from tqdm.auto import tqdm

        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        out: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="engram: scoring")
        for a in range(0, len(order), self.batch):
            idx = order[a:a + self.batch]
            seqs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in idx]
            conts = [requests[i][2] for i in idx]
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), self.pad_id if self.pad_id is not None else self.eos,
                             dtype=torch.long)
            for row, s in enumerate(seqs):
                ids[row, :len(s)] = torch.tensor(s)
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self._device), use_cache=False).logits
            for row, (i, s, cont) in enumerate(zip(idx, seqs, conts)):
                lp = torch.log_softmax(logits[row, len(s) - len(cont):len(s)].float(), dim=-1)  # (len(cont), V)
                want = torch.tensor(cont, device=lp.device)
                out[i] = (float(lp.gather(1, want[:, None]).sum()), bool((lp.argmax(-1) == want).all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
            bar.update(len(idx))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in disjoint windows of `max_length` tokens (the first predicted from
        the EOS prefix), as lm-eval's `hf` model counts it."""
        from lm_eval import utils

        out = []
        for (text,) in [r.args for r in requests]:
            windows = [(None,) + w for w in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))]
            total = sum(lp for lp, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled where the task sets do_sample and a temperature), each cut before the
        first of its `until` strings (and ended at EOS), at most
        `max_gen_toks` tokens (the request's, else the model's default); the context keeps its last tokens when
        it and the budget do not fit `max_length`."""
        import torch
        from tqdm.auto import tqdm
        from transformers import StoppingCriteriaList

        out = []
        for context, asked in tqdm([r.args for r in requests], disable=disable_tqdm, desc="engram: generating"):
            gen = dict(asked or {})
            until = gen.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(gen.get("max_gen_toks", self.max_gen_toks))
            temperature = float(gen.get("temperature", 0.0) or 0.0)
            sample = bool(gen.get("do_sample", False)) and temperature > 0
            ids = self.tok_encode(context)[-max(self.max_length - budget, 1):]
            stop = _StopAt(self.tok, until, len(ids))
            with torch.no_grad():
                new = self.model.generate(torch.tensor([ids], device=self._device), max_new_tokens=budget,
                                          do_sample=sample, temperature=temperature if sample else None,
                                          top_p=gen.get("top_p") if sample else None, top_k=None,
                                          pad_token_id=self.pad_id, stopping_criteria=StoppingCriteriaList([stop]))
            text = self.tok.decode(new[0, len(ids):].tolist())
            for s in until:
                text = text.split(s)[0] if s else text
            self.cache_hook.add_partial("generate_until", (context, asked), text)
            out.append(text)
        return out


def _usable(device):
    """`device`, or None (the CPU) for a CUDA device on a machine without CUDA: lm-eval's CLI asks for "cuda:0"
    when `--device` is left out, and its own `hf` model then runs on the CPU too (with a warning, as here)."""
    if device is None or not str(device).startswith("cuda"):
        return device
    import torch

    if torch.cuda.is_available():
        return device
    import logging

    logging.getLogger(__name__).warning("--device %s: torch sees no CUDA device here; running on the CPU", device)
    return None


class _StopAt:
    """StoppingCriteria: a stop string appeared in the text generated after the first `start` ids."""

    def __init__(self, tok, stops: list[str], start: int):
        self.tok, self.stops, self.start = tok, [s for s in stops if s], start

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        text = self.tok.decode(input_ids[0, self.start:].tolist()) if self.stops else ""
        done = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _register() -> None:
    """"engram" in lm-eval's model registry, as the "module:Class" path lm-eval's own models use (0.4.13's
    `Registry`), or the class itself where the registry is the older dict."""
    try:
        from lm_eval.api.registry import model_registry
    except ImportError:  # (lm-eval before the Registry class)
        from lm_eval.api.registry import register_model

        register_model(NAME)(EngramLM)
    else:
        model_registry.register(NAME, target="engram.integrations.lm_eval:EngramLM")


def main() -> None:
    """lm-eval's CLI with "engram" registered: `python -m engram.integrations.lm_eval --model engram ...`."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":  # (this file run as a program: the module imported by its name registers the class)
    from engram.integrations.lm_eval import main as run

    run()
else:
    _register()
