"""zero3d's communication wing: counted collectives, the DP group's node topology, quantized and hierarchical collectives, and the plan the stages call."""
