"""The stages a file goes through, in data-flow order, and their wiring.

watcher → event_buffer → intake (await queue.put) → queue → preprocess → preprocess_cache →
batcher → model_stage → result_writer, with retry_list feeding back into the queue and
outcomes deciding where each file ends. ``wiring`` builds them and shuts them down in order.
"""
