"""Client partitions: the schemes that split samples over clients (partition; the class-sharding
schemes in shards; the size and count arithmetic in allocation), their statistics
(partition_stats), the embedding clusters that define task-based groups (clustering), the
assignments.csv file that records a partition (assignments) and the names of the two kinds
of partition the experiments compare (groupings).

Modules are imported by name (``from partitioning.partition import ...``), not here, so that
importing one of them does not load the others' heavy dependencies.
"""
