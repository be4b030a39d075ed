"""What the strategy does when a rank fails, hangs or is told to stop: the fault monitor, the rank the others wait
for and where it is, and preemption signals."""
