"""fp8 scaling state: one operand's scaling (``state.operand``), one layer's
(``state.layer``), their saved ``state_dict`` forms and migrations (``state.saved``), and the
one rule for loading them (``state.load``)."""
