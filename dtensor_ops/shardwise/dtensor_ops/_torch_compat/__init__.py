"""PyTorch's semi-private DTensor names, over shardwise's engine: the drop-in surface, kept out of the core.

Code and tests written against ``torch.distributed.tensor``'s private modules import names from
them; each such module exists at PyTorch's path in ``shardwise.dtensor_ops`` and *is* the module
here (a three-line file that binds it under that name too):

=============================================  =======================  ==========================================
PyTorch's path (under torch.distributed.tensor)  here                     over
=============================================  =======================  ==========================================
``_op_schema``                                 ``op_schema``            ``OpSchema``/``OpStrategy``/``OpSpec``, strategy registration -> ``_rules.ShardingRule``
``_sharding_prop``                             ``sharding_prop``        ``ShardingPropagator`` -> ``_decision_pipeline``
``_ops.single_dim_strategy``                   ``single_dim_strategy``  ``register_single_dim_strategy``
``_ops.utils``                                 ``ops_utils``            ``register_op_strategy``, ``expand_to_full_mesh_op_strategy``...
``_ops._view_ops``                             ``view_ops``             dim maps over ``_ops.view_ops``
``_ops._embedding_ops``                        ``embedding_ops``        ``_MaskPartial``
``_collective_utils``                          ``collective_utils``     ``_collectives``, the planner's costs
``_utils``                                     ``utils``                layout math of ``shardwise.placement``
``_dtensor_spec``                              ``dtensor_spec``         ``shardwise.placement``'s ``DTensorSpec``, ``ShardOrderEntry``
``_redistribute``                              ``redistribute``         the executor, ``Redistribute``, the planner vocabulary (``_TransformInfo``..., ``get_redistribute_planner``)
``_ops._matrix_ops``                           ``matrix_ops``           single-dim einsum strategies
``_ops._einsum_strategy``                      ``einsum_strategy``      ``EinsumDims``, full-mesh ``gen_einsum_strategies``
``device_mesh`` (of ``_tensor``)                ``device_mesh``          ``shardwise.mesh``
``_random``                                    ``random``               ``OffsetBasedRNGTracker``, ``_PhiloxState``, ``_rng_tracker`` -> ``_random_draws``
=============================================  =======================  ==========================================

The engine never imports this package: PyTorch-style registrations reach it as ordinary
``ShardingRule`` s of the one rule registry.  Nothing here is imported until a user imports it, but
``op_dispatch``: the package's wiring sets ``DTensor._op_dispatcher`` to it (PyTorch's handle on the
registries), and it imports ``sharding_prop`` only when asked for the propagator.
"""
