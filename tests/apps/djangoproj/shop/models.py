from django.db import models


class Order(models.Model):
    reference = models.CharField(max_length=64, unique=True)
    status = models.CharField(max_length=16, default="new")

    class Meta:
        app_label = "shop"
