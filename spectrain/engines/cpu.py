"""Which x86 instruction sets this CPU really executes, by running one instruction of each.

/proc/cpuinfo is not enough: the development VMs advertise AMX, and ggml's native build (which trusts the
compiler's view of the CPU) then dies with SIGILL at its first matmul. So each set the flags claim is
confirmed by compiling a tiny program that uses one of its instructions and running it; a program killed by
a signal means "no". AMX is never enabled: its tiles need a kernel permission request that VMs refuse, and
SmolLM2-sized models gain nothing from it.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# ggml's CMake option -> (cpuinfo flag, gcc target attribute, intrinsic call on `a`/`b`/`i` of that set)
_PROBES: dict[str, tuple[str, str, str]] = {
    "GGML_SSE42": ("sse4_2", "sse4.2", "r = _mm_crc32_u32((unsigned)i, 7u);"),
    "GGML_AVX": ("avx", "avx", "__m256 v = _mm256_add_ps(_mm256_set1_ps((float)i), _mm256_set1_ps(1)); r = (int)v[0];"),
    "GGML_AVX2": ("avx2", "avx2", "__m256i v = _mm256_add_epi32(_mm256_set1_epi32(i), _mm256_set1_epi32(1)); "
                  "r = _mm256_extract_epi32(v, 0);"),
    "GGML_FMA": ("fma", "fma", "__m256 v = _mm256_fmadd_ps(_mm256_set1_ps((float)i), _mm256_set1_ps(2), "
                 "_mm256_set1_ps(1)); r = (int)v[0];"),
    "GGML_F16C": ("f16c", "f16c", "__m128 v = _mm_cvtph_ps(_mm_set1_epi16((short)i)); r = (int)v[0];"),
    "GGML_BMI2": ("bmi2", "bmi2", "r = (int)_pdep_u32((unsigned)i, 0xffu);"),
    "GGML_AVX_VNNI": ("avx_vnni", "avxvnni", "__m256i v = _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(i), "
                      "_mm256_set1_epi32(1), _mm256_set1_epi32(1)); r = _mm256_extract_epi32(v, 0);"),
    "GGML_AVX512": ("avx512f", "avx512f", "__m512 v = _mm512_add_ps(_mm512_set1_ps((float)i), _mm512_set1_ps(1)); "
                    "r = (int)_mm512_reduce_add_ps(v);"),
    "GGML_AVX512_VBMI": ("avx512vbmi", "avx512f,avx512vbmi", "__m512i v = _mm512_permutexvar_epi8("
                         "_mm512_set1_epi8((char)i), _mm512_set1_epi8(3)); r = _mm512_reduce_add_epi32(v);"),
    "GGML_AVX512_VNNI": ("avx512_vnni", "avx512f,avx512vnni", "__m512i v = _mm512_dpbusd_epi32(_mm512_set1_epi32(i), "
                         "_mm512_set1_epi32(1), _mm512_set1_epi32(1)); r = _mm512_reduce_add_epi32(v);"),
    "GGML_AVX512_BF16": ("avx512_bf16", "avx512f,avx512bf16", "__m512 v = _mm512_dpbf16_ps(_mm512_set1_ps(0), "
                         "(__m512bh)_mm512_set1_epi32(i), (__m512bh)_mm512_set1_epi32(1)); "
                         "r = (int)_mm512_reduce_add_ps(v);"),
}
AMX_OFF = {"GGML_AMX_TILE": False, "GGML_AMX_INT8": False, "GGML_AMX_BF16": False}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _runs(compiler: str, attr: str, body: str, work: Path) -> bool:
    src = work / "probe.c"
    src.write_text("#include <immintrin.h>\n"
                   f'__attribute__((target("{attr}"))) static int probe(int i) {{ int r; {body} return r; }}\n'
                   "int main(int argc, char **argv) { (void)argv; return probe(argc) == 12345; }\n")
    exe = work / "probe"
    built = subprocess.run([compiler, "-O0", str(src), "-o", str(exe)], capture_output=True)
    if built.returncode != 0:  # the compiler cannot target it either, so ggml could not use it
        return False
    return subprocess.run([str(exe)], capture_output=True).returncode in (0, 1)  # a signal -> negative


def ggml_cpu_options(compiler: str | None = None, cpuinfo: str | None = None) -> dict[str, bool]:
    """ggml CMake options (GGML_AVX2=ON ...) for what this machine executes; AMX always off.

    Off x86-64 the dict holds only GGML_NATIVE=OFF (ggml's portable defaults)."""
    opts: dict[str, bool] = {"GGML_NATIVE": False}
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return opts
    compiler = compiler or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise OSError("no C compiler found (cc, gcc or clang): install one, e.g. `apt-get install build-essential`")
    flags = cpu_flags(cpuinfo)
    with tempfile.TemporaryDirectory(prefix="spectrain-isa-") as work:
        for option, (flag, attr, body) in _PROBES.items():
            opts[option] = flag in flags and _runs(compiler, attr, body, Path(work))
    return {**opts, **AMX_OFF}
