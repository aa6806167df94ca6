"""``lightning-bamboo demo``: a local spot cluster that trains through preemptions."""
