"""Chat templates in the tool formats the server reads, for tests (imported by name: tests/engine/serving
is on sys.path). QWEN is Qwen 2.5's tool template as its models ship it, with Qwen 3's
reasoning_content turn and gpt-oss's reasoning_effort line added; the others are the parts of
real templates that name their formats (enough for engine.serving.formats.chat_format)."""

from __future__ import annotations

QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {%- if reasoning_effort is defined %}
        {{- '\\nReasoning: ' + reasoning_effort }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls and not message.reasoning_content) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen 3 Thinking-2507 opens the reasoning in the generation prompt: its answers begin inside it
QWEN_THINKING = QWEN.replace("{{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n",
                             "{{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}\n")

LLAMA3 = ("{%- if tools is not none %}{{- '<|start_header_id|>user<|end_header_id|>' }}Given the following "
          "functions, respond with a JSON for a function call with its proper arguments. Respond in the format "
          '{"name": function name, "parameters": dictionary of argument name and its value}.{%- endif %}'
          "{%- if message.role == 'ipython' %}<|python_tag|>{%- endif %}")

MISTRAL = ("{%- if tools is not none and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
           "{%- endif %}{%- if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}{%- endif %}")

HARMONY = ("{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {{ '{' }}{%- endif %}"
           "<|start|>assistant<|channel|>commentary to=functions.{{ name }} <|constrain|>json<|message|>"
           "{{ args }}<|call|>{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")

GEMMA4 = ("{%- if tools %}<|tool>declaration:{{ tools | tojson | replace('\"', '<|\"|>') }}<tool|>{%- endif %}"
          "{%- if message.tool_calls %}<|tool_call>call:{{ name }}{{ args }}<tool_call|>{%- endif %}"
          "{%- if message.reasoning %}<|channel>thought\n{{ message.reasoning }}<channel|>{%- endif %}"
          "{%- if add_generation_prompt %}<|turn>model\n{%- endif %}")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
