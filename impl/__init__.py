"""kvspec.impl: implementations checked against the specification."""
