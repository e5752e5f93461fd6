"""Evaluation harness: benchmark prompts, data loading and scoring.

``sparseattn.evaluation.longbench`` holds LongBench v1 (English and code tasks): the official prompt
templates and generation lengths, the official metrics re-implemented for exact parity, and the
scoring of prediction files. Nothing here runs a model.
"""
