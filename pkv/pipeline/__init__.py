"""The data a decode step is made of: traces and their readers, page assignment, continuous batching,
the step's page tables, and the plans (buckets, workqueue) with their structural counters.
"""
