"""Evaluation harness: what the evaluation commands run, importable without the command line.

``ppl`` (perplexity runs), ``generation`` (greedy generation, retrieval and RULER tasks, LongBench
predictions), ``longbench`` (LongBench v1's prompts, lengths and official metrics, re-implemented for
exact parity), ``diagnose`` (selection against exact attention), ``shared_prefill`` (one prefill for
several methods), ``runs`` (resumable run directories), ``plots``, ``serving`` (the vLLM benchmark: its workload, runs,
results and profile in ``serving_*``), ``vllm_engine`` (starting, driving and stopping a vLLM engine),
``vllm_ppl`` (perplexity in vLLM) and ``lm_eval_model`` (the lm-evaluation-harness model).
"""
