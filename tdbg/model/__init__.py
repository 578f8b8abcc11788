"""The reader's model, headless: runs, jobs, verdicts, deep-dive results and timelines."""
