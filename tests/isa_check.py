"""Which functions of a built library use instructions beyond the x86-64-v2
baseline ([Note: CPU capabilities] in csrc/cpu/cpu_capability.h): any AVX
(VEX/EVEX-encoded, ymm/zmm/mask registers) or the scalar instructions of
x86-64-v3 (BMI1/2, LZCNT, MOVBE). Functions in the namespaces of the wider
kernel builds may; nothing else may, or the library dies with SIGILL on an
older CPU. `python tests/isa_check.py LIBRARY` prints the offenders."""
from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable

VARIANT_NAMESPACES = ("ringcomm::cpu_avx2::", "ringcomm::cpu_avx512::", "ringcomm::cpu_avx512_bf16::")
V3_SCALAR = frozenset({"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "shlx", "shrx", "sarx", "rorx", "mulx",
                       "pdep", "pext", "lzcnt", "movbe"})
_FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
_WIDE_REGISTER = re.compile(r"%[yz]mm\d|%k[0-7]\b")


def beyond_baseline(instruction: str) -> bool:
    """Whether an AT&T-syntax instruction needs more than x86-64-v2."""
    mnemonic = instruction.split()[0] if instruction.split() else ""
    return mnemonic.startswith("v") or mnemonic in V3_SCALAR or bool(_WIDE_REGISTER.search(instruction))


def offenders(disassembly: Iterable[str]) -> dict[str, list[str]]:
    """{function: its instructions beyond the baseline} for every function of
    `objdump -d -C --no-show-raw-insn` output outside the wider kernel builds."""
    found: dict[str, list[str]] = {}
    function = None
    for line in disassembly:
        match = _FUNCTION.match(line)
        if match:
            function = match.group(1)
            continue
        fields = line.split("\t")
        if function is None or len(fields) < 2 or any(ns in function for ns in VARIANT_NAMESPACES):
            continue
        instruction = fields[-1].strip()
        if beyond_baseline(instruction):
            found.setdefault(function, []).append(instruction)
    return found


def disassemble(library: str) -> list[str]:
    command = ["objdump", "-d", "-C", "--no-show-raw-insn", "-M", "att", library]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()


def main(argv: list[str]) -> int:
    found = offenders(disassemble(argv[1]))
    for function, instructions in found.items():
        print(f"{function}: {len(instructions)} instructions beyond x86-64-v2, e.g. {instructions[:3]}")
    print(f"{len(found)} functions outside {', '.join(VARIANT_NAMESPACES)} use instructions beyond x86-64-v2")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
