"""From result files to what a reader sees: the result envelope, table data, the evidence map,
the step and calibration reports, and the rendered tables.
"""
