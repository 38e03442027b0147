"""PrivPrompt's privacy core: events, accountants, mechanisms, budget ledger, audit statistics.

Pure numpy / scipy / dp-accounting: no torch, Prefect or MLflow here.
"""
