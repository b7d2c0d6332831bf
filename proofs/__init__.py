"""kvspec.proofs: the spec's state machine restated for solvers, and what they prove about it.

``symbolic`` is a Z3 model of ``kvspec.spec``'s actions and invariants (tested to admit exactly
the executable spec's successor); ``lemmas`` the named strengthening lemmas; ``induction`` the
inductive proofs; ``prove`` bounded model checking for shortest counterexamples, confirmed by the
executable spec and enacted on the reference engine (``enact``); ``contracts`` the CrossHair
contracts of the spec's pool mechanisms. Nothing in ``kvspec.spec`` imports this package.
"""
