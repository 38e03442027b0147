"""RAPT (Li et al. 2023): local d_X token privatisation, prompt tuning with privatised token
reconstruction, and the attacks that measure its empirical privacy."""
