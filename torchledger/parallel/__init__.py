"""Layouts from one flag: the named ``--mesh dp=4,cp=2,tp=8,pp=9`` (:mod:`.layout`), the
standard plan torchledger applies when an AuditSpec has no ``parallelize`` (:mod:`.plan`:
FSDP2/HSDP/DDP, TP/SP, context parallel, checkpointing, precision) and pipeline parallelism
composed from traced stage micro-steps (:mod:`.pipeline`)."""
