"""What the method packages share, below them: the layer between the method interface
(``tasks/methods/base.py``) and the packages under ``tasks/methods/<name>/``.

* ``classifiers``: the frozen classifier of a model for the config's labels (``classifier_for``,
  cached per process), a prompt of any kind on it (``prompted``, ``input_length``), label names →
  indices (``label_indices``) and a split's encoding (``encode_split``);
* ``training``: soft-prompt / prefix (DP-)SGD from a method's settings — DP-SGD's plan
  (``dpsgd_settings``, ``dpsgd_event``, ``dpsgd_params``), the DP and the non-private trainer
  (``fit_soft_prompt``, ``fit_nonprivate``), the per-unit tensor of a user privacy unit, the
  non-private copy w_nor and the cross-model pull λ(w − w_nor)/‖w − w_nor‖;
* ``prompt_methods``: the method skeletons several packages extend — DP-SGD on a soft prompt
  (``SoftPromptDPSGD``) and on a prefix (``PrefixDPSGDMethod``, with its flatness diagnostics and
  the report sections they feed), and non-private soft-prompt tuning (``NonPrivateSoftPrompt``);
* ``token_budget``: the public per-text token budget of a causal LM's prompts from the model's
  context and the settings (``text_budget``, ``model_context``) and the cut of one private text to it
  (``clip_tokens``, ``clip_text``) — dp_icl, dp_fewshot and DP-OPT use it.

A method package imports this toolkit, the interface (``tasks.methods`` / ``tasks.methods.base``)
and the data-level modules (``tasks.schema``, ``tasks.errors``, ``tasks.data``, ``tasks.state``,
``tasks.prompts``) — never another method package (``tests/methods/test_architecture_methods.py``). Nothing
here registers a method: a package that uses a skeleton registers its own subclass. This
``__init__`` imports nothing, so importing one module of the toolkit loads only what it needs.
"""
