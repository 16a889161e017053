"""Budget-aware search: where proposer calls go, and what comes of them.

- `allocator`: pure decisions, card by card, on expected end-to-end gain per call (with reasons);
- `tree`: UCT with progressive widening over each card's candidates;
- `proposers`: where kernels come from (`templates`, `anthropic`, `openai`), behind one interface;
- `executor`: compile in parallel, evaluate on one worker per device;
- `store`: the SQLite record of every call and candidate, which a killed build resumes from;
- `run`: the loop that ties them together (`forgepack build`); `prices`: the one LLM price table;
- `cassette`: every LLM exchange recorded with the build, and replayed offline (`FORGEPACK_LLM_REPLAY`);
- `resources`: registers and spills of CUDA kernels (ptxas), for an LLM's feedback.
"""
