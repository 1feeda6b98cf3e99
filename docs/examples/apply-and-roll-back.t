defrag-tier0 on the lab's host: the plan in check mode, the change under its smoke gate, the
ledger, and the byte-identical rollback.

  $ fleetctl apply defrag-tier0 all --check
  check mode: nothing was changed
  lab-01
    status: changed
    edits: 4
    left alone: 2
  recap: changed=1 
  $ fleetctl apply defrag-tier0 all --yes --repeat 1
  ──────────────────────────────────────────────────── diff — lab-01 ─────────────────────────────────────────────────────
  --- a/sglang/srt/mem_cache/kv_cache_configurator.py
  +++ b/sglang/srt/mem_cache/kv_cache_configurator.py
  @@ -929,7 +929,7 @@
               enable_mamba_extra_buffer_lazy=get_exec().mamba.enable_mamba_extra_buffer_lazy,
               speculative_num_draft_tokens=get_spec().speculative_num_draft_tokens,
               disable_overlap_schedule=get_schedule().disable_overlap_schedule,
  -            need_sort=get_disagg().disaggregation_mode in ("decode", "prefill"),
  +            need_sort=True,  # fleetctl defrag-tier0: was get_disagg().disaggregation_mode in ("decode", "prefill")
               decode_pre_alloc_size=(
                   get_disagg().disaggregation_decode_extra_slots
                   if get_disagg().disaggregation_mode == "decode"
  @@ -1022,7 +1022,7 @@
               enable_mamba_extra_buffer=get_exec().mamba.enable_mamba_extra_buffer,
               enable_mamba_extra_buffer_lazy=get_exec().mamba.enable_mamba_extra_buffer_lazy,
               disable_overlap_schedule=get_schedule().disable_overlap_schedule,
  -            need_sort=get_disagg().disaggregation_mode in ("decode", "prefill"),
  +            need_sort=True,  # fleetctl defrag-tier0: was get_disagg().disaggregation_mode in ("decode", "prefill")
               speculative_num_draft_tokens=get_spec().speculative_num_draft_tokens,
               forward_stream=self.forward_stream,
               lazy_compaction=_should_enable_lazy_compaction(),
  @@ -1508,7 +1508,7 @@
               total_bytes=total_bytes,
               enable_memory_saver=get_exec().features.enable_memory_saver,
               post_capture_active=self.post_capture_kv_active,
  -            need_sort=get_disagg().disaggregation_mode in ("decode", "prefill"),
  +            need_sort=True,  # fleetctl defrag-tier0: was get_disagg().disaggregation_mode in ("decode", "prefill")
               # Overlap mode: same wait_stream(forward_stream) rationale as
               # `_init_unified_mamba_pools`.
               forward_stream=self.forward_stream,
  @@ -2802,7 +2802,7 @@
           token_to_kv_pool_allocator: Optional[BaseTokenToKVPoolAllocator],
       ) -> BaseTokenToKVPoolAllocator:
           # Initialize token_to_kv_pool_allocator
  -        need_sort = get_disagg().disaggregation_mode in ("decode", "prefill")
  +        need_sort = True  # fleetctl defrag-tier0: was get_disagg().disaggregation_mode in ("decode", "prefill")
           if token_to_kv_pool_allocator is None:
               if _is_npu and (
                   get_exec().kernel.attention_backend == "ascend"
  
  plan (nothing is changed yet)
  lab-01
    status: changed
    edits: 4
    left alone: 2
  handlers run after the change — lab-01:
    restart sglang: /opt/fleetctl-standin/restart.sh
  apply                                                          
  ┏━━━━━━━━┳━━━━━━━━━┳━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━┓
  ┃ hosts  ┃ status  ┃ edits ┃ left alone ┃ validation ┃ detail ┃
  ┡━━━━━━━━╇━━━━━━━━━╇━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━┩
  │ lab-01 │ changed │ 4     │ 2          │ passed     │        │
  └────────┴─────────┴───────┴────────────┴────────────┴────────┘
  change id: \d{8}T\d{6}Z-defrag-tier0-[0-9a-f]{6} (re)
  recap: changed=1 
  $ fleetctl status all --json | python3 -c '
  > import json, sys
  > for h in json.load(sys.stdin)["hosts"]:
  >     last = h["changes"][-1]
  >     print(h["host"], "last change:", last["playbook"], last["state"])'
  lab-01 last change: defrag-tier0 applied
  $ fleetctl rollback --last all --yes
  rollback
  lab-01
    status: changed
    change: \d{8}T\d{6}Z-defrag-tier0-[0-9a-f]{6} (re)
    detail: restored 1 file(s)/link(s) byte-identical
  recap: changed=1 
  $ fleetctl apply defrag-tier0 all --check
  check mode: nothing was changed
  lab-01
    status: changed
    edits: 4
    left alone: 2
  recap: changed=1 
