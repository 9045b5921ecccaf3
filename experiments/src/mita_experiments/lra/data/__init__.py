"""LRA data: the ListOps and Pathfinder generators and loaders for every task's files."""
