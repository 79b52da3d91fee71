"""Training SSMs against an LLM: distillation (``specinfer train-ssm``), the paper's adaptive
boost-tuning (``specinfer boost-tune``) and the recipe that trains the bundled demo pair
(``specinfer train-demo``).

Terms, defined once:

- *corpus*: local text files (e.g. Python sources), tokenized with the LLM's tokenizer and
  joined with EOS between files.
- *teacher*: the LLM; *student*: the SSM being trained.
- *sample* (boost-tuning): a prompt cut from the corpus plus the LLM's greedy continuation of it.
- *covered*: a sample is covered by an SSM when the SSM's greedy tokens, fed the LLM's
  continuation (teacher forcing), equal the LLM's first ``cover_tokens`` continuation tokens;
  this is exactly the case where a depth-``cover_tokens`` sequence speculation from that SSM
  would be accepted whole. *Coverage*: the fraction of samples covered.
"""
