"""A plain openai-client agent as an external worker of `areal-agent train`:
areal-agent worker --connect URL --token T --agent examples/agents/openai_worker.py:make_agent"""


async def solve(task):  # an areal_agents.client.WorkerTask
    client, tools = task.openai_client(), {t.name: t for t in task.tools}
    messages = list(task.messages)
    for _ in range(4):
        reply = await client.chat.completions.create(
            model=task.model, messages=messages, tools=[t.schema for t in tools.values()]
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content  # the env scores the final answer
        for call in message.tool_calls:
            tool = tools.get(call.function.name)
            out = await tool.acall(call.function.arguments) if tool else None
            content = out.content if out else f"Error: no tool {call.function.name}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return None


def make_agent():
    return solve
