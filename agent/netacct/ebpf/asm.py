"""A small eBPF assembler: the 8-byte instruction encoding, symbolic jumps, and map references.

Encoding (Documentation/bpf/standardization/instruction-set.rst): opcode u8, regs u8 (dst in the low nibble, src
in the high one), off s16, imm s32, little-endian. The 64-bit immediate load (opcode 0x18) takes two slots; with
src = BPF_PSEUDO_MAP_FD (1) its imm is a map fd the kernel swaps for the map. Jump offsets count slots from the
instruction after the jump; `Asm` resolves them from labels so the builder never counts by hand.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# instruction classes
LD, LDX, ST, STX, ALU, JMP, JMP32, ALU64 = range(8)
# sizes (bits 3-4)
W, H, B, DW = 0x00, 0x08, 0x10, 0x18
MEM, IMM = 0x60, 0x00
# source operand (bit 3): immediate or register
K, X = 0x00, 0x08
# ALU operations (bits 4-7)
ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, NEG, MOD, XOR, MOV, ARSH = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0)
# jump operations (bits 4-7)
JA, JEQ, JGT, JGE, JSET, JNE, JSGT, JSGE, CALL, EXIT, JLT, JLE = (
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0)
PSEUDO_MAP_FD = 1
INSN_SIZE = 8

# registers
R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = range(11)
FP = R10

# helpers (enum bpf_func_id)
MAP_LOOKUP_ELEM = 1

_SIZES = {1: B, 2: H, 4: W, 8: DW}


class AsmError(ValueError):
    """A program that cannot be encoded: an unknown label, an operand out of range."""


@dataclass(frozen=True)
class Insn:
    """One 8-byte slot."""

    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0

    def encode(self) -> bytes:
        """The slot's bytes."""
        if not (0 <= self.dst <= 10 and 0 <= self.src <= 10):
            raise AsmError(f"register out of range in {self}")
        if not -(1 << 15) <= self.off < (1 << 15):
            raise AsmError(f"offset {self.off} does not fit 16 bits")
        if not -(1 << 31) <= self.imm < (1 << 32):
            raise AsmError(f"immediate {self.imm} does not fit 32 bits")
        imm = self.imm - (1 << 32) if self.imm >= (1 << 31) else self.imm
        return struct.pack("<BBhi", self.code, (self.src << 4) | self.dst, self.off, imm)


def decode(data: bytes) -> list[Insn]:
    """Slots back from bytes (for tests)."""
    if len(data) % INSN_SIZE:
        raise AsmError(f"{len(data)} bytes is not a whole number of instructions")
    out = []
    for at in range(0, len(data), INSN_SIZE):
        code, regs, off, imm = struct.unpack_from("<BBhi", data, at)
        out.append(Insn(code, regs & 0xF, regs >> 4, off, imm))
    return out


@dataclass
class _Jump:
    index: int
    label: str


@dataclass
class Asm:
    """An instruction list under construction, with labels and map references resolved at `assemble`."""

    insns: list[Insn] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    _jumps: list[_Jump] = field(default_factory=list)
    _maps: list[tuple[int, str]] = field(default_factory=list)
    _fresh: int = 0

    def fresh(self, stem: str) -> str:
        """A label name not used before."""
        self._fresh += 1
        return f"{stem}.{self._fresh}"

    def label(self, name: str) -> None:
        """Mark the next instruction."""
        if name in self.labels:
            raise AsmError(f"label {name} defined twice")
        self.labels[name] = len(self.insns)

    def _emit(self, insn: Insn) -> None:
        self.insns.append(insn)

    # -- ALU --------------------------------------------------------------------------------------------------

    def mov(self, dst: int, src: int) -> None:
        """dst = src (64-bit)."""
        self._emit(Insn(ALU64 | MOV | X, dst, src))

    def movi(self, dst: int, imm: int) -> None:
        """dst = imm (sign-extended to 64 bits)."""
        self._emit(Insn(ALU64 | MOV | K, dst, 0, 0, imm))

    def alu(self, op: int, dst: int, src: int) -> None:
        """dst op= src (64-bit)."""
        self._emit(Insn(ALU64 | op | X, dst, src))

    def alui(self, op: int, dst: int, imm: int) -> None:
        """dst op= imm (64-bit)."""
        self._emit(Insn(ALU64 | op | K, dst, 0, 0, imm))

    def alu32i(self, op: int, dst: int, imm: int) -> None:
        """dst = (u32)(dst op imm): the upper half is zeroed."""
        self._emit(Insn(ALU | op | K, dst, 0, 0, imm))

    def ld_map(self, dst: int, name: str) -> None:
        """dst = the map `name` (a two-slot load; the fd is filled in at `assemble`)."""
        self._maps.append((len(self.insns), name))
        self._emit(Insn(LD | DW | IMM, dst, PSEUDO_MAP_FD))
        self._emit(Insn(0))

    # -- memory -----------------------------------------------------------------------------------------------

    def ldx(self, size: int, dst: int, src: int, off: int) -> None:
        """dst = *(size *)(src + off)."""
        self._emit(Insn(LDX | MEM | _SIZES[size], dst, src, off))

    def stx(self, size: int, dst: int, off: int, src: int) -> None:
        """*(size *)(dst + off) = src."""
        self._emit(Insn(STX | MEM | _SIZES[size], dst, src, off))

    def st(self, size: int, dst: int, off: int, imm: int) -> None:
        """*(size *)(dst + off) = imm."""
        self._emit(Insn(ST | MEM | _SIZES[size], dst, 0, off, imm))

    # -- jumps ------------------------------------------------------------------------------------------------

    def _jump(self, code: int, dst: int, src: int, imm: int, label: str) -> None:
        self._jumps.append(_Jump(len(self.insns), label))
        self._emit(Insn(code, dst, src, 0, imm))

    def ja(self, label: str) -> None:
        """goto label."""
        self._jump(JMP | JA, 0, 0, 0, label)

    def jmpi(self, op: int, dst: int, imm: int, label: str) -> None:
        """if dst op imm goto label (64-bit compare; imm sign-extended)."""
        self._jump(JMP | op | K, dst, 0, imm, label)

    def jmp(self, op: int, dst: int, src: int, label: str) -> None:
        """if dst op src goto label (64-bit)."""
        self._jump(JMP | op | X, dst, src, 0, label)

    def jmp32i(self, op: int, dst: int, imm: int, label: str) -> None:
        """if (u32)dst op (u32)imm goto label: compares a 32-bit field whatever its top bit."""
        self._jump(JMP32 | op | K, dst, 0, imm, label)

    def call(self, helper: int) -> None:
        """Call a kernel helper (R1-R5 arguments, R0 result; R1-R5 are clobbered)."""
        self._emit(Insn(JMP | CALL, 0, 0, 0, helper))

    def exit(self) -> None:
        """Return R0."""
        self._emit(Insn(JMP | EXIT))

    # -- output -----------------------------------------------------------------------------------------------

    def assemble(self, maps: dict[str, int]) -> bytes:
        """The program's bytes, with jump offsets resolved and map fds filled in."""
        out = list(self.insns)
        for jump in self._jumps:
            if jump.label not in self.labels:
                raise AsmError(f"jump to undefined label {jump.label}")
            insn = out[jump.index]
            out[jump.index] = Insn(insn.code, insn.dst, insn.src, self.labels[jump.label] - jump.index - 1, insn.imm)
        for index, name in self._maps:
            if name not in maps:
                raise AsmError(f"no fd for map {name}")
            insn = out[index]
            out[index] = Insn(insn.code, insn.dst, insn.src, insn.off, maps[name])
        return b"".join(insn.encode() for insn in out)
