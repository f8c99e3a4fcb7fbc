"""Attribution: the line of the model's code, or the argument, that each value of a compiled
module comes from.

Read from the optimized HLO (:mod:`jaxmem._src.profile.xla_dump`): each instruction's metadata
holds its Python stack; :mod:`jaxmem._src.frames` says which frames are the model's. A value is
attributed to the first instruction on its data path whose own (innermost) frame is the model's:
through tuples, loop state (a loop's stack to what its body writes each step: the line in the
body), fusions, stack updates, and through what a library's code (Flax's ``nnx.scan`` wrapper,
jaxmem's loops) moves or computes on the model's behalf, back to an argument of the compiled
function where the data is a slice or copy of one. XLA's own scratch, whose data says nothing, is
attributed as the instruction that reads it. Where nothing on the path has the model's frame,
the value falls back to the model's frames further out in a library instruction's stack (the
model's call that led there).
"""

from __future__ import annotations

import dataclasses

from jaxmem._src.frames import Frame
from jaxmem._src.profile.xla_dump import _ORIGIN_STEPS, _PASS_THROUGH, _Instr, _Module, _operand

__all__ = ["attribute"]


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where a value comes from: a line of the model's code with the call chain out to the user's
    file (``chain``, innermost first), or an argument of the compiled function (``argument``,
    its pytree path as JAX names the parameter)."""

    chain: tuple[Frame, ...] = ()
    argument: str = ""


# Opcodes that move data without computing: where their own frame is not the model's (Flax's
# nnx.scan wrapper slicing a layer's weights, jaxmem's loop writing a stack), the data they move
# says where it comes from.
_MOVES = {
    "broadcast", "reshape", "transpose", "convert", "slice", "dynamic-slice", "copy", "bitcast",
    "bitcast-convert", "pad", "reverse", "concatenate", "copy-start", "copy-done",
}  # fmt: skip

# Moves that keep the bytes as they are (a new layout, a copy): even with the model's own frame
# (``lax.scan`` stacking its carry, an XLA copy), the line that made the data made these bytes.
_RELAYOUTS = {"bitcast", "copy", "reshape", "transpose", "copy-start", "copy-done"}


def _data_sources(module: _Module, instr: _Instr, index: tuple[int, ...], direct: bool):
    """Where the data of ``instr``'s value ``index`` comes from, most telling first: what wraps
    or moves data says less than its data, and so does what computes without any model frame
    in its stack (an op jaxmem's loops add); a library's computation with the model's call
    further out in its stack is that call's (Haliax's ``multiply`` inside a Levanter layer)."""
    out = []
    step = _ORIGIN_STEPS.get(instr.opcode)
    nxt = None if step is None else step(module, instr, index)
    if nxt is not None:
        out.append(nxt)
    if instr.opcode == "while" and instr.operands:  # the loop's initial value of the slot
        out.append(_operand(instr, 0, index))
    if out or instr.opcode in _PASS_THROUGH | {"fusion"} or not instr.operands:
        return out
    if instr.opcode in _RELAYOUTS or (not direct and instr.opcode in _MOVES):
        return [_operand(instr, 0, index if instr.opcode in ("copy", "bitcast") else ())]
    if not instr.model_chain:
        out += [_operand(instr, i, ()) for i in range(len(instr.operands))]
    return out


def _where(module: _Module, name: str, index: tuple[int, ...], seen: set) -> _Where | None:
    """The line of the model (or the argument) that the value ``name{index}`` comes from.

    An instruction whose innermost frame is the model's says it, unless it only wraps or moves
    data (tuples, loop state, stack updates, fusions, copies and new layouts: their data says
    more). One whose frame is
    a library's internals (the stack holds the model's call further out) is followed through the
    data it moves, and says its own chain only where the data leads nowhere.
    """
    instr = module.instrs.get(name)
    if instr is None or (name, index) in seen or len(seen) > 512:
        return None
    seen.add((name, index))
    if instr.opcode == "parameter" and instr.computation == module.entry:
        return _Where(argument=instr.op_name or instr.name)
    chain = instr.model_chain
    direct = bool(chain) and chain[0] == instr.frames[0]
    if direct and instr.opcode not in _PASS_THROUGH | _RELAYOUTS | {"fusion"}:
        return _Where(chain=chain)
    for nxt in _data_sources(module, instr, index, direct):
        found = _where(module, *nxt, seen)
        if found is not None:
            return found
    return _Where(chain=chain) if chain else None


def _where_used(module: _Module, name: str) -> _Where | None:
    """For a value whose data says nothing (XLA's own scratch: a copy, a fusion's temporary):
    where the first instruction reading it, in program order, comes from."""
    queue, visited, seen = list(module.users.get(name, ())), {name}, set()
    while queue and len(visited) < 64:
        user = queue.pop(0)
        if user in visited:
            continue
        visited.add(user)
        found = _where(module, user, (), seen)
        if found is not None:
            return found
        queue += module.users.get(user, ())
    return None


def attribute(module: _Module, name: str, index: tuple[int, ...]) -> _Where:
    """Where the value ``name{index}`` comes from: :func:`_where`, else :func:`_where_used`,
    else nowhere (``_Where()``)."""
    return _where(module, name, index, set()) or _where_used(module, name) or _Where()
