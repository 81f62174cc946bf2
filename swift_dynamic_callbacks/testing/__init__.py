"""What the tests, benchmarks and the demo build runs from, shipped with the package so a fresh clone needs no
download (Lightning's ``demos/`` idea): tiny random Qwen2 / LLaMA models with real vendored tokenizers and GSM8K rows
(:mod:`.tiny`), and a simulated memory cliff with injected OOMs (:mod:`.faults`). Nothing on the training path
imports it; the command line's ``prepare-demo`` (the main job's data) does."""
