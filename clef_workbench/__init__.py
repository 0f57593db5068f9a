"""UI-free services of the Clef Workbench: schema library, state input, answers, store, stats, review, runs."""
