"""PyTorch's semi-private DTensor names, over shardwise's engine: the drop-in surface, kept out of the core.

Code and tests written against ``torch.distributed.tensor``'s private modules import names from
them; each such path under ``shardwise.dtensor_ops`` is served by a module here, named in the one
alias table ``pytorch_paths.PYTORCH_PATHS`` (whose import finder binds the module under the path):

=======================  ==========================================
module                   over
=======================  ==========================================
``op_schema``            ``OpSchema``/``OpStrategy``/``OpSpec``, strategy registration -> ``_rules.ShardingRule``
                         (the names of ``strategy_types``, ``strategy_expansion``, ``strategy_choice``,
                         ``strategy_registration``; the registries are ``_engine.ENGINE.registrations``)
``sharding_prop``        ``ShardingPropagator`` -> ``_decision_pipeline``
``single_dim_strategy``  ``register_single_dim_strategy``
``ops_utils``            ``register_op_strategy``, ``expand_to_full_mesh_op_strategy``...
``view_ops``             dim maps over ``_ops.reshaping``
``pointwise_ops``        the names torch's own code calls (``register_inductor_prims``)
``embedding_ops``        ``_MaskPartial``
``collective_utils``     ``_collectives``, the planner's costs
``utils``                layout math of ``shardwise.placement``
``dtensor_spec``         ``shardwise.placement``'s ``DTensorSpec``, ``ShardOrderEntry``
``redistribute``         the executor, ``Redistribute``, the planner vocabulary (``_TransformInfo``..., ``get_redistribute_planner``)
``matrix_ops``           single-dim einsum strategies
``einsum_strategy``      ``EinsumDims``, full-mesh ``gen_einsum_strategies``
``device_mesh``          ``shardwise.mesh``
``random``               ``OffsetBasedRNGTracker``, ``_PhiloxState``, ``_rng_tracker`` -> ``_shard_rng``
=======================  ==========================================

The engine never imports this package: PyTorch-style registrations are held in the engine's maps and reach
its decisions as ordinary ``ShardingRule`` s of the one rule registry (``strategy_registration`` installs
the hook that makes one from the other).  Nothing here is imported until a user imports it, but
``pytorch_paths`` (the table and its finder, which import nothing) and ``op_dispatch``: the package's
wiring sets ``DTensor._op_dispatcher`` to it (PyTorch's handle on the registries), and it imports
``sharding_prop`` only when asked for the propagator.
"""
