"""The chat template of the project's checkpoints (the tiny pairs, the demo pair): Gemma's turn format, with tools
rendered as Gemma-4's own template renders them.

Turns: ``<start_of_turn>ROLE`` newline, the content verbatim (no trim: a conversation's next prompt then starts with
the previous prompt and answer, token for token), ``<end_of_turn>`` newline; ``assistant`` is Gemma's ``model``.

Tools, in Gemma-4's syntax (its ``chat_template.jinja``, which vLLM's and mlx-lm's ``gemma4`` tool parsers read back):
functions declared in a system turn as ``<|tool>declaration:NAME{...}<tool|>`` (bare keys, sorted, strings quoted by
``<|"|>``); calls as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``; each result in the same turn as
``<|tool_response>response:NAME{value:...}<tool_response|>``, the turn left open for the model to go on. A call without
results yet ends with ``<|tool_response>``, where the model stops to wait. The turn markers stay Gemma's (these
tokenizers have ``<start_of_turn>``/``<end_of_turn>``, not Gemma-4's ``<|turn>``/``<turn|>``).
"""

CHAT_TEMPLATE = """{%- macro quoted(text) -%}<|"|>{{ text }}<|"|>{%- endmacro -%}
{%- macro argument(value) -%}
{%- if value is string -%}{{ quoted(value) }}
{%- elif value is boolean -%}{{ 'true' if value else 'false' }}
{%- elif value is mapping -%}{ {%- for key, item in value | dictsort -%}{{ ',' if not loop.first }}{{ key }}:{{ argument(item) }}{%- endfor -%} }
{%- elif value is sequence -%}[ {%- for item in value -%}{{ ',' if not loop.first }}{{ argument(item) }}{%- endfor -%} ]
{%- else -%}{{ value }}
{%- endif -%}
{%- endmacro -%}
{%- macro schema(s) -%}
{%- set kind = (s['type'] or '') | upper -%}
{%- set out = namespace(parts=[]) -%}
{%- if s['description'] -%}{%- set out.parts = out.parts + ['description:' + quoted(s['description'])] -%}{%- endif -%}
{%- if kind == 'STRING' and s['enum'] -%}{%- set out.parts = out.parts + ['enum:' + argument(s['enum'])] -%}{%- endif -%}
{%- if kind == 'ARRAY' and s['items'] is mapping and s['items'] -%}{%- set out.parts = out.parts + ['items:{' + schema(s['items']) + '}'] -%}{%- endif -%}
{%- if s['nullable'] -%}{%- set out.parts = out.parts + ['nullable:true'] -%}{%- endif -%}
{%- if kind == 'OBJECT' and s['properties'] is mapping -%}
{%- set props = namespace(parts=[]) -%}
{%- for key, value in s['properties'] | dictsort -%}{%- set props.parts = props.parts + [key + ':{' + schema(value) + '}'] -%}{%- endfor -%}
{%- set out.parts = out.parts + ['properties:{' + props.parts | join(',') + '}'] -%}
{%- endif -%}
{%- if kind == 'OBJECT' and s['required'] -%}
{%- set names = namespace(parts=[]) -%}
{%- for name in s['required'] -%}{%- set names.parts = names.parts + [quoted(name)] -%}{%- endfor -%}
{%- set out.parts = out.parts + ['required:[' + names.parts | join(',') + ']'] -%}
{%- endif -%}
{%- if kind -%}{%- set out.parts = out.parts + ['type:' + quoted(kind)] -%}{%- endif -%}
{{ out.parts | join(',') }}
{%- endmacro -%}
{{ bos_token }}
{%- set turns = messages -%}
{%- if tools -%}
<start_of_turn>system{{ '\n' }}
{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] }}{%- set turns = messages[1:] -%}{%- endif -%}
{%- for tool in tools -%}
<|tool>declaration:{{ tool['function']['name'] }}{description:{{ quoted(tool['function']['description'] or '') }}
{%- if tool['function']['parameters'] -%},parameters:{ {{- schema(tool['function']['parameters']) -}} }{%- endif -%}
}<tool|>
{%- endfor -%}
<end_of_turn>{{ '\n' }}
{%- endif -%}
{%- for message in turns -%}
{%- if message['role'] != 'tool' -%}
{%- set after_results = loop.index0 > 0 and turns[loop.index0 - 1]['role'] == 'tool' and message['role'] == 'assistant' -%}
{%- if not after_results -%}
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}{{ '\n' }}
{%- endif -%}
{%- set state = namespace(results=false, stopped=false) -%}
{%- if message['tool_calls'] -%}
{%- for call in message['tool_calls'] -%}
<|tool_call>call:{{ call['function']['name'] }}{
{%- if call['function']['arguments'] is mapping -%}
{%- for key, value in call['function']['arguments'] | dictsort -%}{{ ',' if not loop.first }}{{ key }}:{{ argument(value) }}{%- endfor -%}
{%- elif call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}
{%- endif -%}
}<tool_call|>
{%- endfor -%}
{%- for result in turns[loop.index0 + 1:] -%}
{%- if result['role'] != 'tool' -%}{%- set state.stopped = true -%}{%- endif -%}
{%- if not state.stopped -%}
{%- set called = namespace(name=result['name'] or 'unknown') -%}
{%- for call in message['tool_calls'] -%}{%- if call['id'] == result['tool_call_id'] -%}{%- set called.name = call['function']['name'] -%}{%- endif -%}{%- endfor -%}
<|tool_response>response:{{ called.name }}{value:{{ quoted(result['content']) }}}<tool_response|>
{%- set state.results = true -%}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{ message['content'] }}
{%- if message['tool_calls'] and not state.results -%}<|tool_response>
{%- elif not (state.results and not message['content']) -%}<end_of_turn>{{ '\n' }}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not (turns and (turns[-1]['role'] == 'tool' or turns[-1]['tool_calls'])) -%}
<start_of_turn>model{{ '\n' }}
{%- endif -%}
"""
