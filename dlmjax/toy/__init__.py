"""The embedded toy world: tasks, a character tokenizer and tiny models that ship with dlmjax."""
