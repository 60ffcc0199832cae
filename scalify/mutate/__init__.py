"""Mutation testing: plant small bugs in captured distributed graphs and check that the
verifier catches every one that changes the numbers."""
