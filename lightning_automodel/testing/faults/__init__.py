"""Faults injected into real launches: the training script ranks run (:mod:`.fault_train`) and the launcher that
starts it as users do and records how every rank ended (:mod:`.launch`)."""
