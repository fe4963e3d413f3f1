"""llama.cpp built for any x86-64 CPU (deploy/portable-llama-wheel.sh, the CPU image's build): its CPU
backend is one library per instruction-set level, and the executor loads the best one before the
first model (``ferrum_service/executors/llama_cpp/cpu_variants.py``).

The portable wheel's tests run it unpacked on ``PYTHONPATH`` in a subprocess (each process loads
llama.cpp once); they skip where the wheel has not been built (it takes long: the image suite
builds it). The rest runs against the venv's llama.cpp, whose CPU backend is linked in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ferrum_service.executors.llama_cpp import cpu_variants

from .support.servers import REPO

MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 fd:00 1 /opt/ferrum/lib/python3.11/site-packages/llama_cpp/lib/libggml-base.so.0
7f0000002000-7f0000003000 r-xp 00000000 fd:00 2 /opt/ferrum/lib/python3.11/site-packages/llama_cpp/lib/libggml-cpu-haswell.so
7f0000003000-7f0000004000 r--p 00001000 fd:00 2 /opt/ferrum/lib/python3.11/site-packages/llama_cpp/lib/libggml-cpu-haswell.so
"""


def test_mapped_variant_names_the_one_library_loaded():
    assert cpu_variants.mapped_variant(MAPS) == "haswell"
    assert cpu_variants.mapped_variant(MAPS.replace("-haswell", "-x64", 1)) is None  # two: not known
    assert cpu_variants.mapped_variant("") is None


def test_a_build_without_variants_is_left_alone(tmp_path: Path):
    (tmp_path / "libggml.so").write_bytes(b"not a library: never opened")
    assert cpu_variants.load_cpu_variant(tmp_path) is None


def test_the_venv_build_links_its_cpu_backend_in():
    pytest.importorskip("llama_cpp")
    assert cpu_variants.variant_files(cpu_variants.llama_lib_dir()) == []


def _portable_wheel() -> Path:
    r = subprocess.run(["bash", str(REPO / "deploy/portable-llama-wheel.sh"), "--cached"], capture_output=True,
                       text=True, timeout=60)
    wheels = sorted(Path(r.stdout.strip()).glob("llama_cpp_python-*.whl")) if r.returncode == 0 else []
    if not wheels:
        pytest.skip("the portable llama.cpp wheel is not built here (deploy/portable-llama-wheel.sh)")
    return wheels[0]


@pytest.fixture(scope="module")
def portable(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that imports the portable wheel's llama_cpp (unpacked)."""
    site = tmp_path_factory.mktemp("portable-llama")
    with zipfile.ZipFile(_portable_wheel()) as zf:
        zf.extractall(site)
    for lib in (site / "llama_cpp/lib").glob("*.so*"):
        lib.chmod(0o755)
    (site / "llama_cpp/lib/libggml-cpu-sapphirerapids.so").unlink()  # as the CPU image does (AMX)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), str(REPO / "clients/python")])}


PROBE = """
import ctypes, sys
import llama_cpp.llama_cpp as L
from ferrum_service.executors.llama_cpp import backend, cpu_variants
lib = cpu_variants.llama_lib_dir()
assert "site-packages" not in str(lib) and cpu_variants.variant_files(lib), lib
ggml = ctypes.CDLL(str(cpu_variants.ggml_library(lib)))
ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
L.llama_backend_init()  # llama.cpp's own attempt: the Python executable's directory and the cwd
print("without", ggml.ggml_backend_reg_count())
backend.init_backend(L)
print("with", ggml.ggml_backend_reg_count(), cpu_variants.load_cpu_variant())
params = L.llama_model_default_params()
model = L.llama_model_load_from_file(sys.argv[1].encode(), params)
print("model", bool(model))
"""


def test_the_portable_build_loads_no_cpu_backend_by_itself_and_its_best_variant_with_the_executor(portable):
    from .support.llama import gguf

    path = gguf()
    r = subprocess.run([sys.executable, "-c", PROBE, path], env=portable, cwd="/", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["without"] == "0"  # what a model load would meet without cpu_variants
    count, variant = lines["with"].split()
    assert int(count) >= 1
    libs = {p.name for p in (Path(portable["PYTHONPATH"].split(os.pathsep)[0]) / "llama_cpp/lib").glob("libggml-cpu-*.so")}
    assert f"libggml-cpu-{variant}.so" in libs, (variant, libs)
    assert lines["model"] == "True"


def test_the_portable_build_serves_the_same_greedy_tokens_as_the_native_build(portable):
    from ferrum_client import Client

    from ferrum_service.testing.server_process import ServerProcess

    from .support.llama import gguf

    spec = f"llama-cpp,id=llama,path={gguf()},n_ctx=512,threads=2"
    prompt = [1, 504, 3458, 282, 4649, 314]
    tokens = {}
    for name, env in (("portable", portable), ("native", None)):
        with ServerProcess(["--model", spec, "--device", "cpu"], env=env, cwd=REPO, ready_timeout=300) as srv, \
                Client(srv.target) as c:
            tokens[name] = [e.token.token_id for e in c.generate("llama", token_ids=prompt, max_tokens=6)
                            if e.WhichOneof("event") == "token"]
    assert len(tokens["portable"]) == 6
    assert tokens["portable"] == tokens["native"]


def test_variants_that_cannot_load_are_refused_by_name(portable, tmp_path: Path):
    lib = Path(portable["PYTHONPATH"].split(os.pathsep)[0]) / "llama_cpp/lib"
    for name in ("libggml.so", "libggml-base.so"):
        for f in lib.glob(name + "*"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "libggml-cpu-x64.so").write_bytes(b"\x7fELF truncated")
    assert cpu_variants.ggml_library(tmp_path).name == "libggml.so.0"
    code = ("import sys; from pathlib import Path; from ferrum_service.executors.llama_cpp import cpu_variants\n"
            "try:\n    cpu_variants.load_cpu_variant(Path(sys.argv[1]))\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=portable, cwd="/", capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused:" in r.stdout and "libggml-cpu-x64.so" in r.stdout and str(tmp_path) in r.stdout, r.stdout
