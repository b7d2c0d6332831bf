"""Z3's Boolean connectives and ``If``, built without the Python API's checks and coercions.

The proofs build several hundred thousand terms per cell, and most of the time of ``z3.And``,
``z3.Or`` and ``z3.If`` goes to finding a context, checking sorts and coercing arguments that
are already Z3 expressions of the right sort. These functions make the same terms (Z3 hash-conses
them: ``And(a, b)`` here is the very AST of ``z3.And(a, b)``) by calling the C API directly when
every argument is a Z3 expression (and, for ``If``, both branches have one sort), and defer to
z3's own functions otherwise (Python ints and bools, mixed sorts).
"""

from __future__ import annotations

from typing import Any

import z3
from z3 import z3core
from z3.z3 import _to_ast_array, _to_expr_ref

Term = Any


_SIMPLE = (z3.Z3_BOOL_SORT, z3.Z3_INT_SORT)


def _exprs(args: tuple[Any, ...]) -> bool:
    return all(isinstance(a, z3.BoolRef) for a in args)


def And(*args: Term) -> Term:
    if not args or not _exprs(args):
        return z3.And(*args)
    ctx = args[0].ctx
    arr, n = _to_ast_array(args)
    return z3.BoolRef(z3core.Z3_mk_and(ctx.ref(), n, arr), ctx)


def Or(*args: Term) -> Term:
    if not args or not _exprs(args):
        return z3.Or(*args)
    ctx = args[0].ctx
    arr, n = _to_ast_array(args)
    return z3.BoolRef(z3core.Z3_mk_or(ctx.ref(), n, arr), ctx)


def Not(a: Term) -> Term:
    if not isinstance(a, z3.BoolRef):
        return z3.Not(a)
    return z3.BoolRef(z3core.Z3_mk_not(a.ctx.ref(), a.as_ast()), a.ctx)


def Implies(a: Term, b: Term) -> Term:
    if not (isinstance(a, z3.BoolRef) and isinstance(b, z3.BoolRef)):
        return z3.Implies(a, b)
    return z3.BoolRef(z3core.Z3_mk_implies(a.ctx.ref(), a.as_ast(), b.as_ast()), a.ctx)


def If(c: Term, a: Term, b: Term) -> Term:
    if not (
        isinstance(c, z3.BoolRef)
        and isinstance(a, z3.ExprRef)
        and isinstance(b, z3.ExprRef)
        and a.sort_kind() == b.sort_kind() in _SIMPLE
    ):
        return z3.If(c, a, b)
    ctx = c.ctx
    return _to_expr_ref(z3core.Z3_mk_ite(ctx.ref(), c.as_ast(), a.as_ast(), b.as_ast()), ctx)
