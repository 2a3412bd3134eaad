"""fp8 scaling: how each operand of an fp8 weight is scaled, kept and saved.

One operand's ledger and tally and every way it quantizes through them
(``scaling.operand``), one layer's three operands (``scaling.layer``), their checkpoint form
and its checks (``scaling.saved``), and the one rule for loading them (``scaling.load``)."""
