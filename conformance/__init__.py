"""kvspec.conformance: conformance checks of implementations against the specification."""
