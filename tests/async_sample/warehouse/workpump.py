from asgiref.sync import sync_to_async

import django_workpump as workpump

from .models import Notice


@workpump.receptor("warehouse", events=["order.placed"])
async def tell_warehouse(work):
    await sync_to_async(Notice.objects.create)(order=work.payload["order"])
